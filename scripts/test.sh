#!/usr/bin/env bash
# Install what the tests need (from this repo's own files) and run the suite.
#   scripts/test.sh           the suite: everything but the tests marked multinode, bench or long
#   scripts/test.sh --heavy   the multi-host tests (network namespaces, root) and Slurm's (marked multinode)
#   scripts/test.sh --long    the benchmark smoke runs and the long runs under faults or load
#                             (marked bench or long, not multinode)
# The three parts together are every test; CI (.ci/run) runs all three, each under 20 minutes.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -q
set -euo pipefail
cd "$(dirname "$0")/.."
marks="not multinode and not bench and not long"
if [[ "${1:-}" == "--heavy" ]]; then
  marks="multinode"
  shift
elif [[ "${1:-}" == "--long" ]]; then
  marks="(bench or long) and not multinode"
  shift
fi
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -m "$marks" "$@"
