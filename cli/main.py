"""The `stacklens` command line.

Subcommands that read saved profiles need no privilege; `profile`, `demo` and `record` attach
probes themselves (root, or CAP_BPF + CAP_PERFMON + CAP_SYS_PTRACE); `attach`, `detach`, `ps`,
`report PID`, `advise`, `top` talk to a running `stacklensd` over its Unix socket.
Errors come from one hierarchy (`stacklens.errors`) and map to exit codes here.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
from pathlib import Path

from stacklens import __version__
from stacklens.render.formats import FORMATS
from stacklens.render.textreport import short_note
from stacklens.errors import EXIT_INTERRUPTED, EXIT_USAGE, DaemonUnavailable, InputError, StacklensError, exit_codes

DEFAULT_SOCKET = "/run/stacklens/stacklens.sock"
PID_MAX = 2**31 - 1  # pid_t (the daemon's gRPC field is an int32)
JOB_WINDOW_S = 10.0  # advise --job: the window each rank is compared over


def pid_arg(text: str) -> int:
    """argparse type of every PID argument: an integer in 1..2**31-1, else a usage error."""
    try:
        pid = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid PID {text!r}: give a process id (see `stacklens ps`)") from None
    if not 1 <= pid <= PID_MAX:
        raise argparse.ArgumentTypeError(f"invalid PID {pid}: a process id is in 1..{PID_MAX}")
    return pid


def check_seconds(value: float | None, flag: str) -> None:
    """InputError unless `value` (when given) is a finite number of seconds above 0."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise InputError(f"{flag} {value:g}: give a number of seconds above 0, e.g. {flag} 5")


def check_rate(hz: int) -> None:
    if not 1 <= hz <= 10_000:
        raise InputError(f"--rate {hz}: the CPU sampling rate is 1..10000 Hz (default 99)")


def check_output(out: str | None) -> None:
    """Refuses, before any work, an output path that cannot be written: a directory that does not
    exist or is not writable, a path that is a directory or a file that is not writable."""
    if not out:
        return
    path = Path(out)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"-o {out}: that is a directory; give the path of a file")
    if not parent.is_dir():
        raise InputError(f"-o {out}: the directory {parent} does not exist; create it or write elsewhere")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"-o {out}: cannot write there (permission denied or a read-only file system); "
                         "write elsewhere")


def open_output(out: str, *, binary: bool):
    """`out` opened for writing without following a symbolic link that another user owns (root
    writing where anyone may create files, /tmp: a planted link would aim our write at any file);
    a link of our own is followed, as the user meant."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(out, flags | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        owner = os.lstat(out).st_uid
        if owner != os.geteuid():
            raise InputError(f"-o {out}: a symbolic link owned by another user (uid {owner}); not followed: "
                             "write to another path") from None
        fd = os.open(out, flags, 0o644)
    return os.fdopen(fd, "wb" if binary else "w")


def _socket_path(args: argparse.Namespace) -> str:
    return args.socket or os.environ.get("STACKLENS_SOCKET") or DEFAULT_SOCKET


def _check_metric(snap, metric: str) -> None:
    if metric not in snap.metrics:
        raise InputError(
            f"unknown metric {metric!r}; this profile has: {', '.join(snap.metrics)}"
        )


def view_of(snap, form, view: str) -> str:
    """"model" or "full": `view` as asked; "auto" gives the model view to the formats that open on
    it (text) where the profile has torch module calls."""
    if view != "auto":
        return view
    from stacklens.cct.modelview import has_model

    return "model" if form.model_view and has_model(snap) else "full"


def write_output(snap, fmt: str, metric: str | None, out: str | None, view: str = "auto") -> None:
    """Render `snap` as `fmt` (render/formats.py) in `view` (`view_of`) to `out` (a path) or
    stdout; without a metric, the one views open on (GPU time where measured,
    cct/metrics.py opening_metric)."""
    if metric is None:
        from stacklens.cct.metrics import opening_metric

        metric = opening_metric(snap)
    _check_metric(snap, metric)
    form = FORMATS.get(fmt)
    if form is None:  # argparse restricts choices; keep the error honest anyway
        raise InputError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    from stacklens.cct.backwardview import pick_backward_view, split_view

    view, backward = split_view(view)
    snap = pick_backward_view(snap, backward)   # before the model view: the engine's frames collapse too
    if view_of(snap, form, view) == "model":
        from stacklens.cct.modelview import model_view

        snap = model_view(snap)
    if form.binary and out is None and sys.stdout.isatty():
        raise InputError(f"{fmt} is binary: give -o FILE (or redirect stdout)")
    data = form.render(snap, metric)
    if out:
        try:
            with open_output(out, binary=isinstance(data, bytes)) as fh:
                fh.write(data)
        except OSError as e:   # checked before the work (check_output), yet it failed: keep the profile
            raise InputError(f"cannot write {out} ({e.strerror or e}); {_keep(snap)}") from None
    elif isinstance(data, bytes):
        sys.stdout.buffer.write(data)
    else:
        sys.stdout.write(data)


def _keep(snap) -> str:
    """Saves `snap` where it can (a new file in the temporary directory) so that no work is lost;
    says where, or that it could not."""
    import gzip
    import json
    import tempfile

    from stacklens.cct import export

    try:
        fd, path = tempfile.mkstemp(prefix="stacklens-profile-", suffix=".json.gz")
        with os.fdopen(fd, "wb") as fh:
            fh.write(gzip.compress(json.dumps(export.to_json(snap), separators=(",", ":")).encode(), mtime=0))
    except OSError as e:
        return f"the profile could not be saved elsewhere either ({e.strerror or e})"
    return f"the profile is saved in {path}: `stacklens report --input {path} -o FILE` writes it"


def cmd_report(args: argparse.Namespace) -> int:
    check_output(args.output)
    if args.input and args.window is not None:
        raise InputError("--window applies to a live session (a PID, through the daemon); a saved profile "
                         "covers the span it was recorded over: drop --window")
    check_seconds(args.window, "--window")
    if args.input:
        from stacklens.cct import export

        snap = export.load(args.input)
    elif args.pid is not None:
        from stacklens.daemon.client import DaemonClient

        with DaemonClient(_socket_path(args)) as client:
            snap = client.snapshot(args.pid, window_s=args.window)
    else:
        raise InputError("give a PID (through the daemon) or --input FILE (a saved profile)")
    write_output(snap, args.format, args.metric, args.output, args.view)
    return 0


def _oneshot_output(snap, args: argparse.Namespace) -> None:
    """Write a one-shot profile with its account: notes and the window into the snapshot's meta
    (the text header and JSON show them) and on stderr; an empty profile of a target that ran on
    CPU is an error and writes nothing, a short one is written and then reported as an error."""
    from stacklens.cli.oneshot import assess

    lines, error = assess(snap)
    added = [ln[len("note: "):] for ln in lines if ln.startswith("note: ")
             and ln[len("note: "):] not in snap.meta.get("notes", [])]
    if added:
        snap.meta.setdefault("notes", []).extend(added)
    in_output = FORMATS[args.format].shows_notes
    for ln in lines:
        if not in_output or ln.startswith("window: ") or ln[len("note: "):] in added:
            if ln.startswith("note: "):   # whole in the profile's meta (JSON), short here
                ln = "note: " + short_note(ln[len("note: "):], snap.meta.get("pid"))
            print(f"stacklens: {ln}", file=sys.stderr)
    if error is not None and not snap.meta.get("window", {}).get("cpu_samples"):
        raise error
    write_output(snap, args.format, args.metric, args.output, args.view)
    if error is not None:
        raise error


def _running_daemon(socket_path: str, *, named: bool = False, say=None):
    """A client of the stacklensd answering at `socket_path`, or None when there is none to ask
    (no socket): `profile` then compiles its own program. A daemon that is there but does not
    answer: one the user `named` (--socket, $STACKLENS_SOCKET) is an error after 15 s; the
    default one is skipped after 2 s, and `say` tells so (never a silent change of path)."""
    from stacklens.daemon.client import DaemonClient

    if not os.path.exists(socket_path):
        return None
    wait_s = 15.0 if named else 2.0
    try:
        client = DaemonClient(socket_path, timeout=wait_s)
        try:
            client.health()
        except StacklensError:
            client.close()
            raise
    except StacklensError as e:
        if named:
            raise DaemonUnavailable(f"stacklensd at {socket_path} did not answer within {wait_s:g}s ({e}); "
                                    "profile with --no-daemon to compile here instead") from None
        if say is not None:
            say(f"stacklensd at {socket_path} did not answer within {wait_s:g}s: profiling without it")
        return None
    client.timeout = 15.0
    return client


def cmd_profile(args: argparse.Namespace) -> int:
    from stacklens.cli.oneshot import Progress, profile_pid, profile_through_daemon

    check_seconds(args.duration, "--duration")
    check_rate(args.rate)
    check_output(args.output)
    progress = Progress()
    kw = dict(duration_s=args.duration, agent=args.agent, cpu_hz=args.rate, ops=not args.no_ops, progress=progress)
    try:
        named = bool(args.socket or os.environ.get("STACKLENS_SOCKET"))
        client = None if args.no_daemon else _running_daemon(_socket_path(args), named=named, say=progress)
        if client is not None:
            with client:
                snap = profile_through_daemon(client, args.pid, **kw)
        else:
            snap = profile_pid(args.pid, **kw)
    finally:
        progress.close()
    _oneshot_output(snap, args)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from stacklens.cli.demo import run_demo

    live_view = None
    if sys.stdout.isatty() and not args.plain:
        from stacklens.tui.app import run_local as live_view   # the CLI alone joins the TUI and the daemon
    return run_demo(duration_s=args.duration, metric=args.metric, live_view=live_view)


def cmd_doctor(args: argparse.Namespace) -> int:
    from stacklens.cli.doctor import run_doctor

    return run_doctor(pid=args.pid, as_json=args.json)


def cmd_ps(args: argparse.Namespace) -> int:
    from stacklens.cli.daemoncmds import run_ps

    return run_ps(_socket_path(args), as_json=args.json)


def cmd_advise(args: argparse.Namespace) -> int:
    from stacklens.cli.daemoncmds import run_advise

    if args.job:
        from stacklens.cli.daemoncmds import run_advise_job

        return run_advise_job(_socket_path(args), args.pid, window_s=args.window, as_json=args.json)
    return run_advise(_socket_path(args), args.pid, as_json=args.json)


def cmd_completion(args: argparse.Namespace) -> int:
    from stacklens.cli.completion import script

    sys.stdout.write(script(build_parser(), args.shell))
    return 0


def cmd_daemon_call(args: argparse.Namespace) -> int:
    from stacklens.daemon.client import run_client_command

    check_seconds(getattr(args, "wait", None), "--wait")
    return run_client_command(args, _socket_path(args))


def cmd_record(args: argparse.Namespace) -> int:
    from stacklens.cli.oneshot import Progress, record_command

    cmd = [c for c in args.cmd if c != "--"]
    if not cmd:
        raise InputError("give the command to run after --, e.g. stacklens record -- python train.py")
    check_rate(args.rate)
    check_output(args.output)
    progress = Progress()
    try:
        # the profile goes to stdout: the program's own output goes to stderr, never into it
        snap, status = record_command(cmd, agent=args.agent, cpu_hz=args.rate, progress=progress,
                                      program_stdout=None if args.output else 2)
    finally:
        progress.close()
    if status:
        print(f"stacklens: note: {cmd[0]} exited with status {status}", file=sys.stderr)
    _oneshot_output(snap, args)
    return 0


def cmd_dump(args: argparse.Namespace) -> int:
    from stacklens.cli.dump import run_dump

    return run_dump(args.pid, job=args.job, as_json=args.json, all_threads=args.all, socket_path=_socket_path(args))


def cmd_top(args: argparse.Namespace) -> int:
    from stacklens.tui.app import run_top

    return run_top(pid=args.pid, input_path=args.input, socket_path=_socket_path(args))


def exit_codes_epilog() -> str:
    """The exit codes, as `stacklens --help` ends: from the one table (errors.exit_codes)."""
    return "exit codes:\n" + "\n".join(f"  {code:>3}  {meaning}" for code, meaning in exit_codes())


def add_pid(sp: argparse.ArgumentParser, *, required: bool, what: str) -> None:
    """The one way to name a PID: `-p PID` / `--pid PID` on every command that takes one, and a
    bare PID as well (the form `report`, `top`, `attach`, `detach` and `advise` always took);
    `resolve_pid` makes them one `args.pid`."""
    sp.add_argument("pid", nargs="?", type=pid_arg, metavar="PID", help=f"{what} (same as -p PID)")
    sp.add_argument("-p", "--pid", dest="pid_opt", type=pid_arg, metavar="PID", help=what)
    sp.set_defaults(pid_required=required)


def resolve_pid(args: argparse.Namespace, sp: argparse.ArgumentParser) -> None:
    """`args.pid` from `PID` or `-p PID`; a usage error (exit 64) for two different ones or none
    where one is required."""
    if not hasattr(args, "pid_opt"):
        return
    if args.pid is not None and args.pid_opt is not None and args.pid != args.pid_opt:
        sp.error(f"two PIDs given ({args.pid} and -p {args.pid_opt}): give one")
    if args.pid_opt is not None:
        args.pid = args.pid_opt
    if args.pid is None and args.pid_required:
        sp.error("give a PID: -p PID (see `stacklens ps`)")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers by name (for the PID check and the completion scripts)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def out_opts(sp: argparse.ArgumentParser, default_fmt: str = "text") -> None:
    sp.add_argument("-f", "--format", choices=FORMATS, default=default_fmt, help=f"output format (default {default_fmt})")
    sp.add_argument("--metric", default=None,
                    help="metric for " + "/".join(n for n, f in FORMATS.items() if f.per_metric)
                    + " (default: GPU time where it was measured, else CPU samples)")
    sp.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    sp.add_argument("--view", choices=("auto", "model", "full", "forward", "caller", "model+caller", "full+caller"),
                    default="auto",
                    help="model: torch module calls named (transformer.h.3.attn · GPT2Attention), framework "
                    "frames (module call wrappers, decorators, dynamo) collapsed; full: every frame; "
                    "auto (default): model for "
                    + "/".join(n for n, f in FORMATS.items() if f.model_view)
                    + " where the profile has module calls, full for the other formats. "
                    "Backward work: forward (default) on the forward line that caused it, caller under "
                    "the call that ran it (loss.backward(), as py-spy shows it), with auto, or with model/full "
                    "as model+caller / full+caller (docs/backward.md)")

def json_opt(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--json", action="store_true", help="machine-readable output: one JSON document")

def add_profile_commands(command) -> None:
    """The commands that make or render a profile: report, profile, record, demo."""
    r = command("report", "render a profile: a saved file (--input) or a PID via the daemon")
    add_pid(r, required=False, what="the process to report, through the daemon")
    r.add_argument("-i", "--input", metavar="FILE", help="saved profile (stacklens JSON, .json.gz)")
    r.add_argument("--window", type=float, default=None, metavar="SECONDS", help="last N seconds (daemon only)")
    out_opts(r)
    r.set_defaults(func=cmd_report)

    pr = command("profile", "one-shot: attach to PID for a duration, print the profile (root)")
    add_pid(pr, required=True, what="the process to profile")
    pr.add_argument("-d", "--duration", type=float, default=5.0, metavar="SECONDS",
                    help="how long to profile (default 5; through stacklensd, Ctrl-C ends it sooner and "
                         "the profile up to then is written)")
    pr.add_argument("-r", "--rate", type=int, default=99, metavar="HZ", help="CPU sampling rate in Hz (default 99)")
    pr.add_argument("--agent", action="store_true", help="also inject the in-process agent (GPU time, Python sampler)")
    pr.add_argument("--no-ops", action="store_true", help="skip libtorch operator probes")
    pr.add_argument("--no-daemon", action="store_true",
                    help="compile and attach here even when stacklensd runs (by default a running daemon "
                         "does the attach with its compiled program: collecting starts within ~1 s)")
    out_opts(pr)
    pr.set_defaults(func=cmd_profile)

    rec = command("record", "start a command and profile it until it exits (root)")
    rec.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    rec.add_argument("-r", "--rate", type=int, default=99, metavar="HZ", help="CPU sampling rate in Hz (default 99)")
    rec.add_argument("--agent", action="store_true", help="also inject the in-process agent")
    out_opts(rec)
    rec.set_defaults(func=cmd_record)

    d = command("demo", "start a bundled PyTorch workload, attach by PID, show the live tree")
    d.add_argument("-d", "--duration", type=float, default=None, metavar="SECONDS",
                   help="stop after N seconds (default: until Ctrl-C)")
    d.add_argument("--metric", default="cpu_samples")
    d.add_argument("--plain", action="store_true", help="plain text refresh instead of the TUI")
    d.set_defaults(func=cmd_demo)


def add_daemon_commands(command) -> None:
    """doctor, the daemon's commands (attach, detach, advise, ps, top) and completion."""
    doc = command("doctor", "check kernel, headers, tracefs, ptrace scope, BCC, a target's Python/CUDA")
    add_pid(doc, required=False, what="also check this process (its Python, GPU libraries, probed symbols)")
    json_opt(doc)
    doc.set_defaults(func=cmd_doctor)

    for name, hlp in (
        ("attach", "attach the daemon to PID"),
        ("detach", "detach the daemon from PID"),
        ("advise", "advice for PID from the daemon's analyzer"),
    ):
        sp = command(name, hlp)
        add_pid(sp, required=True, what="the process")
        if name == "attach":
            sp.add_argument("--agent", action="store_true", help="inject the in-process agent too")
            sp.add_argument("--job", action="store_true",
                            help="PID is a launcher (torchrun): attach each torch.distributed rank under it "
                            "(RANK in its environment); their series carry rank labels")
            sp.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                            help="follow the attach at most this long (default: as long as it makes progress); "
                            "it goes on in the daemon after, `stacklens ps` shows it attaching")
            sp.set_defaults(func=cmd_daemon_call)
        elif name == "detach":
            sp.set_defaults(func=cmd_daemon_call)
        else:
            json_opt(sp)
            sp.add_argument("--job", action="store_true",
                            help="PID is a launcher (torchrun): compare its attached ranks (the straggler rule)")
            sp.add_argument("--window", type=float, default=JOB_WINDOW_S, metavar="SECONDS",
                            help=f"with --job: the last SECONDS of each rank (default {JOB_WINDOW_S:g})")
            sp.set_defaults(func=cmd_advise)
    ps = command("ps", "processes with a GPU driver, torch or JAX loaded (GPU or not), "
                       "with their state: attached, not attached (never) or detached")
    json_opt(ps)
    ps.set_defaults(func=cmd_ps)

    dm = command("dump", "every thread's Python stack now, and who holds the GIL; the target is "
                         "not stopped, no daemon or agent (root)")
    add_pid(dm, required=True, what="the Python process (with --job: the launcher, e.g. torchrun)")
    dm.add_argument("--job", action="store_true",
                    help="PID is a launcher: dump each rank under it (RANK in its environment), "
                    "say which wait in a collective and which rank is missing")
    dm.add_argument("--all", action="store_true", help="also list threads without Python")
    json_opt(dm)
    dm.set_defaults(func=cmd_dump)

    t = command("top", "live terminal UI (through the daemon, or --input FILE)")
    add_pid(t, required=False, what="the process to show, through the daemon")
    t.add_argument("-i", "--input", metavar="FILE", help="saved profile (stacklens JSON, .json.gz)")
    t.set_defaults(func=cmd_top)

    c = command("completion", "print a shell completion script: "
                "`eval \"$(stacklens completion bash)\"` (bash), `stacklens completion zsh > ~/.zfunc/_stacklens` (zsh)")
    c.add_argument("shell", choices=("bash", "zsh"))
    c.set_defaults(func=cmd_completion)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stacklens",
        description="Whole-stack profiler for running PyTorch/JAX processes: "
        "Python line -> operator -> native frame -> GPU API -> GPU kernel.",
        epilog=exit_codes_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"stacklens {__version__}")
    p.add_argument("--socket", help=f"daemon socket (default $STACKLENS_SOCKET or {DEFAULT_SOCKET})")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, hlp: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=hlp, description=hlp, epilog="exit codes: see `stacklens --help`")

    add_profile_commands(command)
    add_daemon_commands(command)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "command", None):
            resolve_pid(args, subcommands(parser)[args.command])
    except SystemExit as e:  # argparse: --help/--version exit 0, misuse exits 2 -> EX_USAGE
        code = e.code if isinstance(e.code, int) else 1
        return 0 if code == 0 else EXIT_USAGE
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except StacklensError as e:
        print(f"stacklens: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `stacklens report … | head` closes stdout early: not an error.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
