#!/usr/bin/env bash
# Install the etcd server the etcd tests run (Debian package etcd-server, 3.4.23)
# when the `etcd` binary is missing; a no-op when it is present.
set -euo pipefail
if command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ]; then
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server
# the package enables a systemd service; the tests start their own servers
command -v systemctl >/dev/null 2>&1 && $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
etcd --version | head -1
