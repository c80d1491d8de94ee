#!/usr/bin/env bash
# The whole test suite (the README's test command; .ci/run calls it). Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
set +e
.venv/bin/python -m pytest tests -q --timeout=900 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as failure" >&2
  exit 1
fi
exit "$rc"
