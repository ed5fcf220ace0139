"""Issue 23 acceptance 3 without pytest: memcpy/memset GPU time per path against torch.profiler
(same experiment and checks as tests/gpu/test_copies.py). Writes OUT/copies.json (order join) and
OUT/copies_api.json (API-record join, unless --modes order), OUT/copies_checks.json; exit 0 iff
every check passed.

    python benchmarks/gpu/check_copies.py --out DIR [--steps 200] [--mib 8] [--modes order,api]
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.gpu.copies import checks, context, run_experiment  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--modes", default="order,api")
    a = ap.parse_args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    npass = nfail = 0
    allv = {}
    for mode in [m for m in a.modes.split(",") if m]:
        try:
            rec = run_experiment(steps=a.steps, out_dir=a.out, api_records=mode == "api", mib=a.mib)
            v = checks(rec)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            print(f"copies [{mode}]: the experiment did not complete")
            nfail += 1
            continue
        for name, (ok, msg) in v.items():
            print(f"{'PASS' if ok else 'FAIL'} [{mode}] {name}: {msg}")
        if not all(ok for ok, _ in v.values()):
            print(context(rec))
        allv[mode] = {k: list(x) for k, x in v.items()}
        npass += sum(ok for ok, _ in v.values())
        nfail += sum(not ok for ok, _ in v.values())
    (Path(a.out) / "copies_checks.json").write_text(json.dumps(allv, indent=1))
    print(f"copies: {npass} passed, {nfail} failed")
    return 0 if nfail == 0 and npass else 1


if __name__ == "__main__":
    sys.exit(main())
