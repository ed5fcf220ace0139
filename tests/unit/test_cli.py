"""The CLI surface: help, version, report conversion and its errors (exit codes from stacklens.errors)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from stacklens import __version__
from stacklens.cct import CCT, Frame, METRICS
from stacklens.cct import export
from stacklens.cli.main import main
from stacklens.errors import InputError


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stacklens.cli.main", *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def profile_file(tmp_path):
    t = CCT(metrics=METRICS)
    step = Frame.python("train.py", "step", 42)
    fwd = Frame.python("model.py", "forward", 17)
    t.add((step, fwd, Frame.op("aten::linear"), Frame.op("aten::addmm")), "cpu_samples", 30)
    t.add((step, Frame.python("train.py", "load", 12)), "cpu_samples", 10)
    path = tmp_path / "p.json"
    export.save(t.snapshot(meta={"pid": 1234}), path, "json")
    return path


def test_help_lists_subcommands():
    r = run_cli("--help")
    assert r.returncode == 0
    for sub in ("report", "profile", "demo", "doctor", "attach", "top"):
        assert sub in r.stdout


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"stacklens {__version__}"


def test_missing_input_is_a_clear_error(tmp_path):
    r = run_cli("report", "--input", str(tmp_path / "nope.json"))
    assert r.returncode == InputError.exit_code
    assert "nope.json" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"format": "other"}', gzip.compress(b"[1,2")])
def test_corrupt_input_is_a_clear_error(tmp_path, content):
    bad = tmp_path / ("bad.json.gz" if content.startswith(b"\x1f\x8b") else "bad.json")
    bad.write_bytes(content)
    r = run_cli("report", "--input", str(bad))
    assert r.returncode == InputError.exit_code, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.startswith("stacklens: error:")


def test_report_folded(profile_file, capsys):
    assert main(["report", "--input", str(profile_file), "--format", "folded", "--metric", "cpu_samples"]) == 0
    lines = sorted(capsys.readouterr().out.splitlines())
    assert lines == [
        "step (train.py:42);forward (model.py:17);aten::linear;aten::addmm 30",
        "step (train.py:42);load (train.py:12) 10",
    ]


def test_report_text_and_unknown_metric(profile_file, capsys):
    assert main(["report", "--input", str(profile_file)]) == 0
    out = capsys.readouterr().out
    assert "op:aten::addmm" in out and "75.0%" in out
    assert main(["report", "--input", str(profile_file), "--metric", "nope"]) == InputError.exit_code


def test_report_pprof_and_speedscope_to_files(profile_file, tmp_path):
    pb = tmp_path / "p.pb.gz"
    ss = tmp_path / "p.speedscope.json"
    assert main(["report", "-i", str(profile_file), "--format", "pprof", "-o", str(pb)]) == 0
    assert gzip.decompress(pb.read_bytes())  # a gzip stream; the schema round trip is in test_export
    assert main(["report", "-i", str(profile_file), "--format", "speedscope", "-o", str(ss)]) == 0
    assert json.loads(ss.read_text())["$schema"].startswith("https://www.speedscope.app/")


def test_usage_error_exit_code():
    assert main(["report", "--format", "nope"]) == 64
