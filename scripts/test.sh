#!/usr/bin/env bash
# Install what the tests need (from this repo's own files) and run the suite.
#   scripts/test.sh           the suite: everything but the tests marked multinode, bench or long
#   scripts/test.sh --heavy   those: multi-host (network namespaces, root), Slurm, the
#                             benchmark smoke run and the long training runs under faults or
#                             load; CI (.ci/run) runs both parts
# Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -q
set -euo pipefail
cd "$(dirname "$0")/.."
marks="not multinode and not bench and not long"
if [[ "${1:-}" == "--heavy" ]]; then
  marks="multinode or bench or long"
  shift
fi
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -m "$marks" "$@"
