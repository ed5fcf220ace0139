"""stacklens.render: a `Snapshot` as the formats people and other tools read — the text report,
folded stacks, pprof, speedscope — and the table of output formats (`formats.py`).

Pure: no privilege, no I/O; imports only `stacklens.cct`, `stacklens.textsafe` and
`stacklens.errors` (import-linter contract). The profile's own JSON and columnar forms are
`stacklens.cct.export`, which reads them back too.
"""
