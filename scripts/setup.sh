#!/usr/bin/env bash
# Set up a fresh machine for elaunch: a virtualenv in .venv with torch (the CPU
# wheel 2.13.0 — an unpinned `torch` would pull a multi-GB CUDA build), elaunch
# itself (editable) and the example's dependency (scikit-learn).
#   scripts/setup.sh          runtime + example
#   scripts/setup.sh --test   also the test dependencies (the etcd server, scripts/install-etcd.sh; the
#                             Prometheus server, scripts/install-prometheus.sh; Slurm and munge,
#                             scripts/install-slurm.sh)
#                             and tests/plugins/elaunch_test_plugin, a package registering torchrun
#                             entry points (torchrun.logs_specs, torchrun.handlers) for the plugin tests
set -euo pipefail
cd "$(dirname "$0")/.."
extras="examples"
[ "${1:-}" = "--test" ] && extras="examples,test"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
.venv/bin/python -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
pip install -e ".[${extras}]"
if [ "${1:-}" = "--test" ]; then
  pip install --no-deps ./tests/plugins/elaunch_test_plugin
  bash scripts/install-etcd.sh || echo "warning: could not install etcd-server; the etcd tests will be skipped" >&2
  bash scripts/install-prometheus.sh || echo "warning: could not install prometheus; the tests with a real Prometheus server will be skipped" >&2
  bash scripts/install-slurm.sh || echo "warning: could not install Slurm; the Slurm tests (tests/slurm) will be skipped" >&2
fi
.venv/bin/python -c "import torch, psutil, click, elaunch; print('elaunch', elaunch.__version__, 'torch', torch.__version__)"
