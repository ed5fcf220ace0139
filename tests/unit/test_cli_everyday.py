"""The CLI's everyday surface (issue 30): one way to name a PID (`-p PID`, `--pid PID`, and the bare
PID where it always worked) on every command that takes one, py-spy's short flags, shell
completion generated from the parser, `--json` for ps/advise/doctor (checked with jq and
json.loads), the exit-code table in --help and README, whole states in `ps`, short notes.

Runs a real stacklensd gRPC server in-process (sessions that serve a recorded profile: no root)
and the CLI as a subprocess against it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stacklens.cct import CCT, METRICS, Frame, export
from stacklens.cli.completion import commands
from stacklens.cli.main import build_parser, main, resolve_pid, subcommands
from stacklens.errors import EXIT_USAGE, DaemonUnavailable, InputError, NoSuchProcess, exit_codes
from stacklens.render.textreport import NOTE_MAX, render_report, short_note
from tests.grpc_daemon import RecordedSession

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "tests" / "data" / "gpu_kernel_fusion" / "problem.json"
TARGETS = ROOT / "tests" / "targets"
PID_COMMANDS = ("report", "profile", "doctor", "attach", "detach", "advise", "top", "dump")
LONG_NOTE = "/usr/lib/libcuda.so.1: probes on exported versions: " + "; ".join(
    f"cuCall{i} -> cuCall{i}, cuCall{i}_v2, cuCall{i}_ptsz" for i in range(40))


def run_cli(*args: str, socket: str | None = None, stdin=None) -> subprocess.CompletedProcess:
    pre = ["--socket", socket] if socket else []
    return subprocess.run([sys.executable, "-m", "stacklens.cli.main", *pre, *args],
                          capture_output=True, text=True, timeout=60, stdin=stdin)


def jq(expr: str, text: str) -> str:
    """`jq -e expr` over `text`: fails the test unless jq parses it and the result is true/non-null."""
    r = subprocess.run(["jq", "-e", "-r", expr], input=text, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"jq {expr!r}: rc={r.returncode} {r.stderr} on {text[:300]!r}"
    return r.stdout.strip()


@pytest.fixture
def session_factory():
    """Sessions serving PROFILE; the attach note is the long list of probed symbols a real attach
    to libcuda writes."""
    return lambda pid, **kw: RecordedSession(pid, PROFILE, LONG_NOTE, **kw)


@pytest.fixture
def daemon(daemon) -> str:
    """The daemon's socket, which is how the CLI is told of it."""
    return str(daemon.socket_path)


@pytest.fixture
def gpu_target(tmp_path):
    """A process that maps a file named libcuda.so.1 (a copy of this Python's libc-linked binary
    is not needed: any ELF file does), as discovery sees GPU processes."""
    lib = tmp_path / "libcuda.so.1"
    shutil.copy(sys.executable, lib)
    p = subprocess.Popen([sys.executable, str(TARGETS / "mapped_libcuda.py"), str(lib)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    yield p.pid
    p.kill()
    p.wait()


# ---- one way to name a PID --------------------------------------------------------------------

def parse(*argv: str):
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_pid(args, subcommands(parser)[args.command])
    return args


@pytest.mark.parametrize("command", PID_COMMANDS)
@pytest.mark.parametrize("form", (("-p", "4242"), ("--pid", "4242"), ("--pid=4242",), ("4242",)))
def test_every_pid_command_takes_p_pid_and_the_bare_pid(command, form):
    assert parse(command, *form).pid == 4242


def test_the_commands_that_take_a_pid_are_exactly_those_listed():
    """A new command with a PID gets -p/--pid (add_pid), and this test's list with it."""
    with_pid = {name for name, sp in subcommands(build_parser()).items()
                if any(a.dest == "pid_opt" for a in sp._actions)}
    assert with_pid == set(PID_COMMANDS)


@pytest.mark.parametrize("argv", (["attach"], ["detach"], ["advise"], ["profile"],
                                  ["attach", "4242", "-p", "4243"], ["report", "-p", "0"],
                                  ["profile", "-p", "x"], ["nosuchcommand"]))
def test_a_missing_or_doubled_or_bad_pid_is_a_usage_error(argv, capsys):
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err


def test_the_same_pid_twice_is_one_pid():
    assert parse("attach", "4242", "-p", "4242").pid == 4242


def test_py_spy_short_flags():
    a = parse("profile", "-p", "7", "-d", "2.5", "-r", "50", "-o", "out.txt", "-f", "folded")
    assert (a.pid, a.duration, a.rate, a.output, a.format) == (7, 2.5, 50, "out.txt", "folded")
    a = parse("record", "-r", "33", "-f", "json", "-o", "p.json", "--", "python", "-c", "pass")
    assert (a.rate, a.format, a.output, a.cmd) == (33, "json", "p.json", ["--", "python", "-c", "pass"])
    assert parse("demo", "-d", "3").duration == 3.0
    a = parse("report", "-i", "in.json", "-f", "pprof", "-o", "p.pb.gz")
    assert (a.input, a.format, a.output) == ("in.json", "pprof", "p.pb.gz")


def test_report_short_flags_write_what_the_long_ones_print(tmp_path, capsys):
    t = CCT(metrics=METRICS)
    t.add((Frame.python("train.py", "step", 3), Frame.op("aten::mm")), "cpu_samples", 5)
    src, out = tmp_path / "p.json", tmp_path / "p.folded"
    export.save(t.snapshot(meta={"pid": 1}), src, "json")
    assert main(["report", "--input", str(src), "--format", "folded", "--metric", "cpu_samples"]) == 0
    printed = capsys.readouterr().out
    assert main(["report", "-i", str(src), "-f", "folded", "--metric", "cpu_samples", "-o", str(out)]) == 0
    assert "aten::mm" in printed and out.read_text() == printed


def test_daemon_commands_take_p_pid_and_the_bare_pid_alike(daemon, target):
    """attach/report/advise/detach through a real daemon, each named both ways."""
    r = run_cli("attach", "-p", str(target), socket=daemon)
    assert r.returncode == 0, r.stderr
    assert f"attached to {target}" in r.stdout
    for form in (["-p", str(target)], [str(target)]):
        rep = run_cli("report", *form, "-f", "json", socket=daemon)
        assert rep.returncode == 0, rep.stderr
        assert json.loads(rep.stdout)["format"] == export.to_json(export.load(PROFILE))["format"]
        adv = run_cli("advise", *form, socket=daemon)
        assert adv.returncode == 0 and adv.stdout.startswith("["), adv.stderr
    r = run_cli("detach", "--pid", str(target), socket=daemon)
    assert r.returncode == 0 and str(target) in r.stdout, r.stderr
    r = run_cli("advise", "-p", str(os.getpid()), socket=daemon)   # never attached
    assert r.returncode == NoSuchProcess.exit_code, (r.stdout, r.stderr)


def test_doctor_takes_p_pid(target):
    r = run_cli("doctor", "-p", str(target), "--json")
    assert r.returncode in (0, 1), r.stderr
    assert jq(f'[.checks[].name] | index("pid {target}") != null', r.stdout) == "true"


# ---- shell completion -------------------------------------------------------------------------

def complete(script: Path, *words: str) -> list[str]:
    """What bash's completion function offers for the command line `words` (the last one being
    completed)."""
    line = " ".join(f"'{w}'" for w in words)
    r = subprocess.run(["bash", "--norc", "-c", f'source {script}; COMP_WORDS=({line}); '
                        f'COMP_CWORD={len(words) - 1}; _stacklens; printf "%s\\n" "${{COMPREPLY[@]}}"'],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return [w for w in r.stdout.splitlines() if w]


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory):
    r = run_cli("completion", "bash")
    assert r.returncode == 0, r.stderr
    path = tmp_path_factory.mktemp("completion") / "stacklens.bash"
    path.write_text(r.stdout)
    return path


def test_bash_completion_is_valid_bash(bash_script):
    r = subprocess.run(["bash", "-n", str(bash_script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_bash_completion_completes_the_subcommands_from_the_parser(bash_script):
    names = sorted(subcommands(build_parser()))
    assert sorted(complete(bash_script, "stacklens", "")) == names
    assert complete(bash_script, "stacklens", "pr") == ["profile"]
    assert complete(bash_script, "stacklens", "--socket", "/tmp/s", "do") == ["doctor"]


def test_bash_completion_completes_options_and_choices(bash_script):
    assert "--json" in complete(bash_script, "stacklens", "ps", "--")
    assert set(complete(bash_script, "stacklens", "profile", "-")) >= {"-p", "--pid", "-d", "-r", "-o", "-f"}
    assert sorted(complete(bash_script, "stacklens", "report", "-f", "")) == sorted(
        next(a for a in subcommands(build_parser())["report"]._actions if a.dest == "format").choices)
    assert sorted(complete(bash_script, "stacklens", "completion", "")) == ["bash", "zsh"]
    pids = complete(bash_script, "stacklens", "attach", "-p", "")
    assert pids and all(p.isdigit() for p in pids)


def test_zsh_completion_names_every_subcommand_and_option():
    r = run_cli("completion", "zsh")
    assert r.returncode == 0 and r.stdout.startswith("#compdef stacklens\n")
    _, subs = commands(build_parser())
    for s in subs:
        assert f"_stacklens_{s.name}() {{" in r.stdout and f"'{s.name}:" in r.stdout
        for o in s.options:
            assert all(f"{f}[" in r.stdout for f in o.flags)
    if shutil.which("zsh"):
        z = subprocess.run(["zsh", "-n"], input=r.stdout, capture_output=True, text=True, timeout=30)
        assert z.returncode == 0, z.stderr


# ---- --json -----------------------------------------------------------------------------------

def test_doctor_json_is_valid_and_matches_its_exit_status():
    r = run_cli("doctor", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == (0 if doc["ok"] else 1)
    assert jq('[.checks[] | .status] | all(. == "ok" or . == "fail" or . == "n/a")', r.stdout) == "true"
    assert jq('[.checks[].name] | index("kernel") != null', r.stdout) == "true"


def test_doctor_json_lists_a_gpu_library_s_probes(gpu_target):
    r = run_cli("doctor", "--pid", str(gpu_target), "--json")
    doc = json.loads(r.stdout)
    probes = [c for c in doc["checks"] if c["name"] == "probes libcuda.so.1"]
    assert len(probes) == 1 and probes[0]["status"] == "n/a", probes  # a copy of python exports no cu* call
    assert "0/" in probes[0]["detail"] and "not exported: cu" in probes[0]["detail"]


def test_ps_json_and_text_show_whole_states(daemon, target, gpu_target):
    assert run_cli("attach", str(target), socket=daemon).returncode == 0
    r = run_cli("ps", "--json", socket=daemon)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    states = {p["pid"]: p["state"] for p in doc["processes"]}
    assert states[target] == "attached" and states[gpu_target] == "not attached"
    assert jq(f'.processes[] | select(.pid == {gpu_target}) | .state', r.stdout) == "not attached"
    assert jq(f'.processes[] | select(.pid == {gpu_target}) | .gpu', r.stdout) == "true"
    text = run_cli("ps", socket=daemon)
    row = next(ln for ln in text.stdout.splitlines() if ln.split()[0] == str(gpu_target))
    assert " not attached " in row


def test_advise_json_is_the_text_s_findings(daemon, target):
    assert run_cli("attach", "-p", str(target), socket=daemon).returncode == 0
    r = run_cli("advise", "-p", str(target), "--json", socket=daemon)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["pid"] == target and doc["findings"]
    text = run_cli("advise", str(target), socket=daemon).stdout
    for f in doc["findings"]:
        assert f"[{f['severity']}] {f['rule']}: {f['title']}" in text
    assert int(jq(".findings | length", r.stdout)) == len(doc["findings"])
    assert jq(".findings[0].evidence[0].metric", r.stdout)


def test_json_commands_without_a_daemon_exit_9_with_nothing_on_stdout(tmp_path):
    for argv in (["ps", "--json"], ["advise", "-p", "1", "--json"]):
        r = run_cli(*argv, socket=str(tmp_path / "none.sock"))
        assert r.returncode == DaemonUnavailable.exit_code and r.stdout == "", r
        assert r.stderr.startswith("stacklens: error:")


# ---- exit codes -------------------------------------------------------------------------------

def test_help_lists_every_exit_code_of_the_table():
    r = run_cli("--help")
    assert r.returncode == 0
    epilog = r.stdout[r.stdout.index("exit codes:"):]
    for code, meaning in exit_codes():
        assert f"{code:>3}  {meaning}" in epilog
    assert "stacklens --help" in run_cli("attach", "--help").stdout


def test_readme_lists_the_same_exit_codes():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Exit codes"):]
    section = section[:section.index("\n## ")]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert rows == [f"| {c} | {m} |" for c, m in exit_codes()]


def test_exit_codes_are_the_ones_documented(tmp_path):
    codes = dict(exit_codes())
    assert {0, 1, 2, 3, 9, EXIT_USAGE, 130} <= set(codes)
    assert run_cli("nosuch").returncode == EXIT_USAGE
    assert run_cli("report", "-i", str(tmp_path / "none.json")).returncode == InputError.exit_code == 2
    assert run_cli("--version").returncode == 0


# ---- short notes ------------------------------------------------------------------------------

def test_a_long_note_keeps_its_first_items_and_says_how_many_more():
    short = short_note(LONG_NOTE, 4242)
    assert len(LONG_NOTE) > 1000 and len(short) < NOTE_MAX + 80
    kept = short.split("…")[0].split("; ")
    assert LONG_NOTE.startswith(short.split("…")[0])
    assert short.endswith(f"… ({40 - len(kept)} more: `stacklens doctor --pid 4242` or --json)")
    assert short_note("short note", 1) == "short note"
    assert short_note("x" * 500).endswith("… (300 more characters: `stacklens doctor --pid PID` or --json)")


def test_the_text_report_shortens_notes_and_json_keeps_them_whole(tmp_path, capsys):
    t = CCT(metrics=METRICS)
    t.add((Frame.python("train.py", "step", 3),), "cpu_samples", 5)
    src = tmp_path / "p.json"
    export.save(t.snapshot(meta={"pid": 77, "notes": [LONG_NOTE, "backward link: on"]}), src, "json")
    text = render_report(export.load(src), "cpu_samples")
    notes = [ln for ln in text.splitlines() if ln.startswith("note: ")]
    assert notes == [f"note: {short_note(LONG_NOTE, 77)}", "note: backward link: on"]
    assert main(["report", "-i", str(src), "-f", "json"]) == 0
    assert LONG_NOTE in json.loads(capsys.readouterr().out)["meta"]["notes"]


def test_attach_prints_its_notes_short(daemon, target):
    r = run_cli("attach", "-p", str(target), socket=daemon)
    assert r.returncode == 0, r.stderr
    assert short_note(LONG_NOTE, target) in r.stdout.splitlines()
    assert max(len(ln) for ln in r.stdout.splitlines()) < NOTE_MAX + 80
