"""`stacklens dump PID` of a process stuck in a GPU sync, with stacklensd attached (real probes,
the fake libcuda: tests/targets/fake_cuda_hang.py): the dump names the call still waiting with
its line, and the kernel the thread launched last with its launching line; without a daemon
attached it says why the GPU side is not known, at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.daemon_proc import Daemon, until

TARGET = Path(__file__).resolve().parents[1] / "targets" / "fake_cuda_hang.py"
BIN = Path(sys.executable).parent


def marker(m: str) -> int:
    return next(i for i, s in enumerate(TARGET.read_text().splitlines(), 1) if s.rstrip().endswith(m))


def test_dump_of_a_process_stuck_in_a_sync_names_the_wait_and_the_last_launch(tmp_path, bpf_ok, fake_libs,
                                                                               start_target):
    t = start_target("fake_cuda_hang.py", str(fake_libs["dir"]), env={"FAKE_SYNC_US": str(600_000_000)})
    # no daemon: the Python stacks, and why the GPU side is not known, without waiting for one
    t0 = time.monotonic()
    r = subprocess.run([str(BIN / "stacklens"), "--socket", str(tmp_path / "none.sock"), "dump", str(t.pid)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "GPU side: not known (no stacklensd at" in r.stdout, r.stdout + r.stderr
    assert time.monotonic() - t0 < 30
    d = Daemon(tmp_path)
    try:
        r = d.cli("attach", str(t.pid))
        assert r.returncode == 0, r.stdout + r.stderr
        t.send()                                   # launch, then wait in cuCtxSynchronize for 10 min
        launch, wait = marker("# LAUNCH"), marker("# WAIT")

        def stuck():
            r = d.cli("dump", "--json", str(t.pid))
            assert r.returncode == 0, r.stderr
            g = json.loads(r.stdout)["gpu_in_flight"]
            return g if g.get("waiting") else None
        g = until("the wait in cuCtxSynchronize seen in flight", stuck, timeout=120)
        [w] = g["waiting"]
        assert w["api"].startswith("cuCtxSynchronize") and w["since_s"] >= 0
        assert f"py:{TARGET}:step:{wait}" in w["path"] and w["path"][-1].startswith("api:cuCtxSynchronize")
        [x] = [x for x in g["last_launches"] if x["tid"] == w["tid"]]
        assert x["kernel"] == "long_kernel" and f"py:{TARGET}:step:{launch}" in x["path"]
        text = d.cli("dump", str(t.pid)).stdout
        assert "waits in cuCtxSynchronize" in text and f"{TARGET}:{wait} (step)" in text, text
        assert "last launched long_kernel" in text and f"{TARGET}:{launch} (step)" in text, text
    finally:
        d.stop()
