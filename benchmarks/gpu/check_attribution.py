"""The ground-truth attribution check without pytest (same experiment and checks as
tests/gpu/test_attribution.py). Writes OUT/attribution.json; exit 0 iff every check passed.

    python benchmarks/gpu/check_attribution.py --out DIR [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.gpu.attribution import checks, context, run_experiment  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    try:
        rec = run_experiment(steps=a.steps, out_dir=a.out)
        v = checks(rec)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        print("attribution: 0 passed, 1 failed (the experiment did not complete)")
        return 1
    for name, (ok, msg) in v.items():
        print(f"{'PASS' if ok else 'FAIL'} {name}: {msg}")
    if not all(ok for ok, _ in v.values()):
        print(context(rec))
    (Path(a.out) / "attribution_checks.json").write_text(json.dumps({k: list(x) for k, x in v.items()}, indent=1))
    npass = sum(ok for ok, _ in v.values())
    print(f"attribution: {npass} passed, {len(v) - npass} failed")
    return 0 if npass == len(v) else 1


if __name__ == "__main__":
    sys.exit(main())
