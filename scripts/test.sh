#!/usr/bin/env bash
# Install what the tests need (from this repo's own files) and run the suite.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -q
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
