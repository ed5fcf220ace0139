"""Thresholds for the rules, configurable per rule.

Pure data, no privilege, no I/O.

    RuleConfig()                                             # defaults everywhere
    RuleConfig.from_dict({"min_saving": 0.01,
                          "disabled": ["hotspots"],
                          "rules": {"sync_stalls": {"min_share": 0.05}}})

A rule reads `config.param(RULE, "min_share", DEFAULT)`: the per-rule override if one was given,
else the rule's own default. Unknown keys in `rules` are kept, so plugin rules read theirs the
same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from stacklens.errors import InputError


@dataclass(frozen=True)
class RuleConfig:
    rules: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    disabled: frozenset[str] = frozenset()
    # Findings that promise less than this and are not informational are dropped by analyze().
    min_saving: float = 0.0

    def __post_init__(self) -> None:
        frozen = {str(k): MappingProxyType(dict(v)) for k, v in dict(self.rules).items()}
        object.__setattr__(self, "rules", MappingProxyType(frozen))
        object.__setattr__(self, "disabled", frozenset(self.disabled))

    def param(self, rule: str, name: str, default: Any) -> Any:
        value = self.rules.get(rule, {}).get(name, default)
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            try:
                return type(default)(value) if isinstance(default, float) else value
            except (TypeError, ValueError):
                raise InputError(f"rule {rule!r}: {name} must be a number, got {value!r}") from None
        return value

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RuleConfig:
        """Build from a plain dict (e.g. a parsed TOML table); unknown top-level keys are errors."""
        data = dict(data or {})
        unknown = set(data) - {"rules", "disabled", "min_saving"}
        if unknown:
            raise InputError(
                f"unknown analyzer settings {sorted(unknown)}: use 'rules', 'disabled' or 'min_saving'"
            )
        rules = data.get("rules", {})
        if not isinstance(rules, Mapping) or not all(isinstance(v, Mapping) for v in rules.values()):
            raise InputError("analyzer 'rules' must map a rule id to a table of thresholds")
        return cls(
            rules=rules,
            disabled=frozenset(data.get("disabled", ())),
            min_saving=float(data.get("min_saving", 0.0)),
        )


def as_config(config: RuleConfig | Mapping[str, Any] | None) -> RuleConfig:
    if config is None:
        return RuleConfig()
    if isinstance(config, RuleConfig):
        return config
    return RuleConfig.from_dict(config)
