#!/usr/bin/env bash
# Install Debian's chromium for tests/test_view.py (the viewer's page, rendered in a real headless browser).
# Idempotent: nothing to do when /usr/bin/chromium is there. CI runs as root on Debian; elsewhere run it with sudo.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  echo "chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || true)"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends chromium
/usr/bin/chromium --version
