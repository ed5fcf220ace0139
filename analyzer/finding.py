"""What a rule returns: one piece of advice tied to a calling context.

Pure data, no privilege, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SEVERITIES = ("high", "medium", "low")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass(frozen=True)
class Finding:
    """One piece of advice.

    `path` holds frame labels (`Frame.label()`), outermost first, down to the Python line the
    advice is about (deeper when the context has no Python frame). `evidence` holds the numbers
    the rule read; a metric the snapshot did not measure appears as `<metric>_unavailable = 1`,
    never as 0. `estimated_saving` is a share (0..1) of the process's time that the fix is
    expected to give back; 0 for purely informational findings such as hotspots.
    """

    rule: str
    severity: str
    path: tuple[str, ...]
    title: str
    evidence: dict[str, float] = field(default_factory=dict)
    fix: str = ""
    estimated_saving: float = 0.0

    def __post_init__(self) -> None:
        if self.severity not in _RANK:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")
        if not 0.0 <= self.estimated_saving <= 1.0:
            raise ValueError(f"estimated_saving is a share in 0..1, got {self.estimated_saving!r}")

    def sort_key(self) -> tuple[int, float, str, tuple[str, ...]]:
        return (_RANK[self.severity], -self.estimated_saving, self.rule, self.path)


def severity_for(share: float, high: float, medium: float) -> str:
    """Severity from the share of the process's time a finding is about."""
    if share >= high:
        return "high"
    if share >= medium:
        return "medium"
    return "low"
