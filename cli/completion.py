"""`stacklens completion bash|zsh`: a shell completion script generated from the CLI's argparse
parser, so every subcommand, option and choice it offers is the one the parser accepts.

No privilege, no I/O but stdout; the scripts complete PIDs from `ps -e` and paths from the shell.
Install: `eval "$(stacklens completion bash)"` in ~/.bashrc; for zsh, `stacklens completion zsh`
into a file `_stacklens` on $fpath.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

FILE_DESTS = frozenset({"output", "input", "socket"})   # options whose value is a path


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    help: str
    takes_value: bool
    kind: str                 # "choices", "pid", "file", "command" (the rest of the line), "" (a value, no hint)
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    options: tuple[Option, ...]
    positionals: tuple[Option, ...]


def _kind(a: argparse.Action) -> str:
    if a.choices is not None:
        return "choices"
    if a.dest in ("pid", "pid_opt"):
        return "pid"
    if a.dest in FILE_DESTS:
        return "file"
    if a.nargs == argparse.REMAINDER:
        return "command"
    return ""


def _describe(parser: argparse.ArgumentParser) -> tuple[tuple[Option, ...], tuple[Option, ...]]:
    opts, pos = [], []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction) or a.help == argparse.SUPPRESS:
            continue
        o = Option(tuple(a.option_strings), a.help or "", a.nargs != 0, _kind(a),
                   tuple(str(c) for c in a.choices) if a.choices is not None else ())
        (opts if a.option_strings else pos).append(o)
    return tuple(opts), tuple(pos)


def commands(parser: argparse.ArgumentParser) -> tuple[Command, list[Command]]:
    """The parser itself (its global options) and each subcommand, as plain data."""
    opts, pos = _describe(parser)
    top = Command(parser.prog, parser.description or "", opts, pos)
    subs = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in a._choices_actions}
            for name, sp in a.choices.items():
                subs.append(Command(name, helps.get(name, ""), *_describe(sp)))
    return top, subs


# ---- bash ----------------------------------------------------------------------------------------

def _bash_value(o: Option) -> str:
    """The bash statement that completes `o`'s value into COMPREPLY."""
    if o.kind == "choices":
        return f'COMPREPLY=($(compgen -W {shlex.quote(" ".join(o.choices))} -- "$cur"))'
    if o.kind == "pid":
        return 'COMPREPLY=($(compgen -W "$(ps -eo pid= 2>/dev/null)" -- "$cur"))'
    if o.kind == "command":
        return 'COMPREPLY=($(compgen -c -- "$cur"))'
    if o.kind == "file":
        return 'COMPREPLY=($(compgen -f -- "$cur"))'
    return "COMPREPLY=()"


def _bash_case(c: Command, indent: str) -> list[str]:
    flags = " ".join(f for o in c.options for f in o.flags)
    lines = [f'{indent}case "$prev" in']
    for o in c.options:
        if o.takes_value:
            lines.append(f"{indent}    {'|'.join(o.flags)}) {_bash_value(o)}; return ;;")
    lines.append(f"{indent}esac")
    lines.append(f'{indent}if [[ "$cur" == -* ]]; then')
    lines.append(f'{indent}    COMPREPLY=($(compgen -W {shlex.quote(flags)} -- "$cur")); return')
    lines.append(f"{indent}fi")
    if c.positionals:
        lines.append(f"{indent}{_bash_value(c.positionals[0])}")
    return lines


def bash(parser: argparse.ArgumentParser) -> str:
    top, subs = commands(parser)
    fn = f"_{top.name}"
    top_value_flags = "|".join(f for o in top.options if o.takes_value for f in o.flags)
    names = " ".join(s.name for s in subs)
    out = [
        f"# bash completion for {top.name}, generated from its argparse parser: `{top.name} completion bash`",
        f"{fn}() {{",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}" cmd="" i',
        "    COMPREPLY=()",
        "    for ((i = 1; i < COMP_CWORD; i++)); do   # the subcommand: the first word not an option",
        '        case "${COMP_WORDS[i]}" in',
    ]
    if top_value_flags:
        out.append(f"            {top_value_flags}) ((i++)) ;;")
    out += [
        "            -*) ;;",
        '            *) cmd="${COMP_WORDS[i]}"; break ;;',
        "        esac",
        "    done",
        '    case "$cmd" in',
        '        "")',
    ]
    out += _bash_case(top, " " * 12)   # the global options; no positional: then the subcommands
    out.append(f'            COMPREPLY=($(compgen -W {shlex.quote(names)} -- "$cur")) ;;')
    for s in subs:
        out.append(f"        {s.name})")
        if any(p.kind == "command" for p in s.positionals):   # after `--`: the command line to run
            out += ["            for ((i = 1; i < COMP_CWORD; i++)); do",
                    '                if [[ "${COMP_WORDS[i]}" == -- ]]; then',
                    "                    if ((i == COMP_CWORD - 1)); then "
                    'COMPREPLY=($(compgen -c -- "$cur")); else COMPREPLY=($(compgen -f -- "$cur")); fi',
                    "                    return",
                    "                fi",
                    "            done"]
            s = Command(s.name, s.help, s.options, ())
        out += _bash_case(s, " " * 12)
        out.append("            ;;")
    out += ["    esac", "}", f"complete -o default -F {fn} {top.name}", ""]
    return "\n".join(out)


# ---- zsh -----------------------------------------------------------------------------------------

def _zsh_text(text: str) -> str:
    """`text` inside a single-quoted _arguments spec: no brackets, colons escaped, quotes closed."""
    text = " ".join(text.split()).replace("[", "(").replace("]", ")").replace(":", r"\:")
    return text.replace("'", "'\\''")


def _zsh_action(o: Option) -> str:
    return {"choices": f"({' '.join(o.choices)})", "pid": "_pids", "file": "_files",
            "command": "_normal"}.get(o.kind, " ")


def _zsh_specs(c: Command) -> list[str]:
    specs = []
    for o in c.options:
        excl = f"({' '.join(o.flags)})" if len(o.flags) > 1 else ""
        for f in o.flags:
            value = f":{_zsh_text(o.flags[-1].lstrip('-'))}:{_zsh_action(o)}" if o.takes_value else ""
            specs.append(f"'{excl}{f}[{_zsh_text(o.help)}]{value}'")
    for i, p in enumerate(c.positionals, 1):
        if p.kind == "command":
            specs.append("'*::command:_normal'")
        else:
            specs.append(f"'{i}:{_zsh_text(p.help or p.kind or 'value')}:{_zsh_action(p)}'")
    return specs


def zsh(parser: argparse.ArgumentParser) -> str:
    top, subs = commands(parser)
    fn = f"_{top.name}"
    out = [f"#compdef {top.name}",
           f"# zsh completion for {top.name}, generated from its argparse parser: `{top.name} completion zsh`", ""]
    for s in subs:
        out.append(f"{fn}_{s.name}() {{")
        out.append("    _arguments -s \\")
        out += [f"        {spec} \\" for spec in _zsh_specs(s)]
        out[-1] = out[-1].removesuffix(" \\")
        out += ["}", ""]
    out += [f"{fn}() {{",
            "    local curcontext=\"$curcontext\" state line",
            "    _arguments -C \\"]
    out += [f"        {spec} \\" for spec in _zsh_specs(Command(top.name, "", top.options, ()))]
    out += ["        '1:command:->command' \\",
            "        '*::argument:->argument'",
            "    case $state in",
            "        command)",
            "            local -a cmds",
            "            cmds=("]
    out += [f"                '{s.name}:{_zsh_text(s.help)}'" for s in subs]
    out += ["            )",
            f"            _describe -t commands '{top.name} command' cmds ;;",
            "        argument)",
            "            case $words[1] in"]
    out += [f"                {s.name}) {fn}_{s.name} ;;" for s in subs]
    out += ["            esac ;;", "    esac", "}", "", f'{fn} "$@"', ""]
    return "\n".join(out)


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    return {"bash": bash, "zsh": zsh}[shell](parser)
