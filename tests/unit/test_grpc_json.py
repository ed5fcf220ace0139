"""ProcessInfo as JSON (grpcurl, protobuf's json_format) carries numbers or nothing, never the
string "NaN" (issue 30.6): a GPU share that was not measured is unset (absent; null where unset
fields are printed), a measured 0 stays a number. Real gRPC server, fake probes behind the Protocol.
"""

from __future__ import annotations

import json
import time

from google.protobuf import json_format

from stacklens.cli.daemoncmds import run_ps, to_json
from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon.client import DaemonClient, ps_lines


def _strict_json(text: str):
    """json.loads that refuses NaN/Infinity, which are not JSON."""
    def refuse(name):
        raise AssertionError(f"{name} in JSON: {text}")

    return json.loads(text, parse_constant=refuse)


def _as_json(msg) -> str:
    return json_format.MessageToJson(msg, preserving_proto_field_name=True)


def test_an_unmeasured_gpu_share_is_absent_not_nan(daemon, target, capsys):
    with DaemonClient(str(daemon.socket_path), timeout=10) as c:
        c.attach(target)             # probes only: no agent, so no GPU time
        deadline = time.monotonic() + 10
        while True:                  # the session reports 'attached' once its first snapshot is in
            (p,) = [p for p in c.processes() if p.pid == target]
            if p.attached or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert p.attached, p.state
        assert "gpu_time_ns" in p.unavailable
        assert not p.HasField("gpu_time_share")
        resp = c.stub.ListProcesses(pb.ListProcessesRequest(), metadata=c._md, timeout=10)
    text = _as_json(resp)
    assert "NaN" not in text
    (row,) = [r for r in _strict_json(text)["processes"] if r["pid"] == target]
    assert "gpu_time_share" not in row
    assert row["unavailable"] and "gpu_time_ns" in row["unavailable"]
    # printing every field (grpcurl -emit-defaults) still leaves an unset optional out, not "NaN"
    try:
        full = json_format.MessageToJson(resp, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)
    except TypeError:            # protobuf < 5.26 names it so
        full = json_format.MessageToJson(resp, preserving_proto_field_name=True,
                                         including_default_value_fields=True)
    (row,) = [r for r in _strict_json(full)["processes"] if r["pid"] == target]
    assert row.get("gpu_time_share") is None and row["launches_per_s"] == 0
    # `stacklens ps --json`: every field, the unmeasured one as null
    assert run_ps(str(daemon.socket_path), as_json=True) == 0
    (row,) = [r for r in _strict_json(capsys.readouterr().out)["processes"] if r["pid"] == target]
    assert "gpu_time_share" in row and row["gpu_time_share"] is None


def test_a_measured_share_is_a_number_zero_included():
    for share in (0.0, 0.25):
        row = _strict_json(_as_json(pb.ProcessInfo(pid=7, gpu_time_share=share)))
        assert row["gpu_time_share"] == share
        assert isinstance(row["gpu_time_share"], (int, float))


def test_ps_json_writes_null_for_unset_and_nan_and_keeps_a_measured_zero():
    shares = {1: None, 2: float("nan"), 3: 0.0, 4: 0.25}
    rows = [pb.ProcessInfo(pid=pid) if v is None else pb.ProcessInfo(pid=pid, gpu_time_share=v)
            for pid, v in shares.items()]
    got = {r["pid"]: r["gpu_time_share"] for r in (to_json(p) for p in rows)}
    assert got == {1: None, 2: None, 3: 0.0, 4: 0.25}
    assert to_json(rows[0])["launches_per_s"] == 0.0   # a field without presence keeps its default


def test_ps_shows_na_for_unset_and_for_an_older_daemons_nan():
    rows = [pb.ProcessInfo(pid=1, comm="a", state="attached"),
            pb.ProcessInfo(pid=2, comm="b", state="attached", gpu_time_share=float("nan")),
            pb.ProcessInfo(pid=3, comm="c", state="attached", gpu_time_share=0.0),
            pb.ProcessInfo(pid=4, comm="d", state="attached", gpu_time_share=0.25)]
    gpu = {int(line.split()[0]): line.split()[4] for line in ps_lines(rows)[1:]}
    assert gpu == {1: "n/a", 2: "n/a", 3: "0.0", 4: "25.0"}
