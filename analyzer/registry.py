"""The rule registry: built-in rules plus plugins from the `stacklens.rules` entry-point group.

Pure, no privilege; reads installed package metadata once, on first use.

A rule is a stateless function `rule(snapshot, *, config) -> list[Finding]` (STYLE.md rule 7).
A plugin package registers one with

    [project.entry-points."stacklens.rules"]
    my_rule = "my_pkg.rules:my_rule"

The entry-point name is the rule id used in `RuleConfig` (`disabled`, `rules.<id>`). A plugin
that fails to load is reported by `plugin_errors()` and skipped; it never breaks analysis.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from importlib.metadata import entry_points

from stacklens.cct import Snapshot

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding

Rule = Callable[..., list[Finding]]
ENTRY_POINT_GROUP = "stacklens.rules"

_builtin: dict[str, Rule] = {}
_plugins: dict[str, Rule] | None = None
_plugin_errors: dict[str, str] = {}
_lock = threading.Lock()


def rule(rule_id: str) -> Callable[[Rule], Rule]:
    """Decorator for built-in rules: registers `fn` under `rule_id`."""

    def register_builtin(fn: Rule) -> Rule:
        _builtin[rule_id] = fn
        fn.rule_id = rule_id  # type: ignore[attr-defined]
        return fn

    return register_builtin


def register(rule_id: str, fn: Rule) -> None:
    """Register a rule at run time (tests, notebooks); replaces a rule with the same id."""
    _builtin[rule_id] = fn


def unregister(rule_id: str) -> None:
    _builtin.pop(rule_id, None)


def _load_plugins() -> dict[str, Rule]:
    global _plugins
    with _lock:
        if _plugins is None:
            found: dict[str, Rule] = {}
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                try:
                    fn = ep.load()
                except Exception as exc:  # a broken plugin must not break analysis
                    _plugin_errors[ep.name] = f"{type(exc).__name__}: {exc}"
                    continue
                if not callable(fn):
                    _plugin_errors[ep.name] = f"{ep.value} is not callable"
                    continue
                found[ep.name] = fn
            _plugins = found
        return _plugins


def rules() -> dict[str, Rule]:
    """Every registered rule by id: plugins first, so a built-in id cannot be shadowed."""
    out = dict(_load_plugins())
    out.update(_builtin)
    return out


def plugin_errors() -> dict[str, str]:
    _load_plugins()
    return dict(_plugin_errors)


