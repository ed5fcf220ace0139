"""The `stacklens` command line (placeholder until the CLI lands)."""

def main(argv=None) -> int:  # replaced below in this session
    raise SystemExit(0)
