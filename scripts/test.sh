#!/usr/bin/env bash
# Install what the tests need (from this repo's own files) and run the suite.
#   scripts/test.sh           the suite: everything but the tests marked multinode or bench
#   scripts/test.sh --heavy   those: multi-host (network namespaces, root), Slurm and the
#                             benchmark smoke run; CI (.ci/run) runs both parts
# Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -q
set -euo pipefail
cd "$(dirname "$0")/.."
marks="not multinode and not bench"
if [[ "${1:-}" == "--heavy" ]]; then
  marks="multinode or bench"
  shift
fi
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -m "$marks" "$@"
