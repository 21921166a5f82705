#!/usr/bin/env bash
# Install the Prometheus server the metrics tests scrape the agents with (Debian package
# prometheus, 2.42 on bookworm; promtool comes with it) when the `prometheus` binary is
# missing; a no-op when it is present.
# The package enables and may start a service (on :9090, scraping itself); the tests start
# their own servers (own config and TSDB in a temporary directory), so no packaged service
# is left running. --no-install-recommends keeps prometheus-node-exporter (another service)
# out.
set -euo pipefail
have() { command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; }
if have; then
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus
if command -v systemctl >/dev/null 2>&1; then
  $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
# without systemd the package's init script may have started it: stop that one too
if [ -x /etc/init.d/prometheus ]; then
  $SUDO /etc/init.d/prometheus stop >/dev/null 2>&1 || true
fi
have
prometheus --version 2>&1 | head -1
