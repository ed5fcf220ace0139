"""Issue 31 acceptance 3 (GPU, root; run by hand on the GPU machine, not collected by pytest):

    python tests/gpu/hung_sync.py [--cycles 2e10] [--out report.json]

A job stuck in ``torch.cuda.synchronize()`` behind a long kernel (tests/targets/cuda_hang.py),
attached by PID through stacklensd with probes only. While it waits, ``stacklens dump PID`` must
name the waiting call with the WAIT line, and the thread's last launch with its kernel and the
LAUNCH line; the dump's own time is stated. Prints a JSON report; exit 0 when all hold.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = Path(__file__).resolve().parents[1] / "targets" / "cuda_hang.py"
CLI = [sys.executable, "-m", "stacklens.cli.main"]


def marker(m: str) -> int:
    return next(i for i, s in enumerate(TARGET.read_text().splitlines(), 1) if s.rstrip().endswith(m))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", default="2e10")
    ap.add_argument("--out")
    a = ap.parse_args()
    sock = Path(tempfile.mkdtemp(prefix="sl-hang-")) / "s.sock"
    d = subprocess.Popen([sys.executable, "-m", "stacklens.daemon.server", "--socket", str(sock),
                          "--metrics-address", "off"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert "ready" in d.stdout.readline()
    t = subprocess.Popen([sys.executable, str(TARGET), a.cycles], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    report: dict = {"ok": False}
    try:
        assert t.stdout.readline().strip() == "ready"
        r = subprocess.run([*CLI, "--socket", str(sock), "attach", str(t.pid)], capture_output=True, text=True,
                           timeout=300)
        report["attach_rc"] = r.returncode
        t.stdin.write("go\n")
        t.stdin.flush()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            r = subprocess.run([*CLI, "--socket", str(sock), "dump", "--json", str(t.pid)], capture_output=True,
                               text=True, timeout=60)
            report["dump_s"] = round(time.monotonic() - t0, 3)
            g = json.loads(r.stdout).get("gpu_in_flight", {}) if r.returncode == 0 else {"error": r.stderr[-500:]}
            if g.get("waiting"):
                break
            time.sleep(0.2)
        report["gpu_in_flight"] = g
        report["text"] = subprocess.run([*CLI, "--socket", str(sock), "dump", str(t.pid)], capture_output=True,
                                        text=True, timeout=60).stdout[-3000:]
        wait_line, launch_line = f"{TARGET}:step:{marker('# WAIT')}", f"{TARGET}:step:{marker('# LAUNCH')}"
        waits = [w for w in g.get("waiting", []) if any(p.endswith(wait_line) for p in w["path"])]
        report["wait_named"] = bool(waits) and waits[0]["api"].startswith("cuCtxSynchronize")
        tids = {w["tid"] for w in waits}
        launches = [x for x in g.get("last_launches", []) if x["tid"] in tids]
        report["launch_named"] = bool(launches) and any(p.endswith(launch_line) for p in launches[0]["path"]) \
            and not launches[0]["kernel"].startswith("unresolved:")
        report["kernel"] = launches[0]["kernel"] if launches else None
        report["ok"] = report["wait_named"] and report["launch_named"]
    finally:
        t.kill()
        d.terminate()
        d.wait(30)
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
