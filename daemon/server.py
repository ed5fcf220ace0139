"""stacklensd (placeholder)."""

def main(argv=None) -> int:
    raise SystemExit(0)
