#!/usr/bin/env bash
# Install Slurm (Debian's slurmctld, slurmd, slurm-client; 22.05 on bookworm) and munge
# for tests/slurm, when slurmctld is missing; a no-op when it is present.
# The packages enable services; the tests start their own daemons (own slurm.conf,
# munge key and sockets in a temporary directory), so the services are disabled.
set -euo pipefail
if command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 \
   && command -v sbatch >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  slurmctld slurmd slurm-client munge
if command -v systemctl >/dev/null 2>&1; then
  $SUDO systemctl disable --now slurmctld slurmd munge >/dev/null 2>&1 || true
fi
slurmctld -V
