#!/usr/bin/env bash
# Runs every test tier that this machine can run (unit, integration, bpf as root; gpu is skipped
# without a GPU). Extra arguments go to pytest. Exit 5 ("no tests collected") is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "test: .venv missing; run: bash scripts/setup.sh" >&2
  exit 2
fi
export PYTHONDONTWRITEBYTECODE=1
.venv/bin/python -m pytest -p no:cacheprovider "${@:-tests}"
rc=$?
if [ $rc -eq 5 ]; then
  echo "test: pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit $rc
