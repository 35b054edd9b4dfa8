#!/usr/bin/env bash
# Installs the CLI harnesses that tests/test_harnesses.py drives (Claude Code, Codex) into .harnesses/ in the repo
# root with npm. Node 20 does: Claude Code is a native binary, Codex's launcher a node script. Idempotent: an install
# that already has both at these versions does nothing. Run in the background beside the tests, it marks itself with
# .harnesses/.installing, which the tests wait for; .installed, written last, says the install is whole.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=.harnesses
PACKAGES="@anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0"
if [ "$(cat "$PREFIX/.installed" 2>/dev/null)" = "$PACKAGES" ]; then
  exit 0
fi
mkdir -p "$PREFIX"
rm -f "$PREFIX/.installed"
touch "$PREFIX/.installing"
trap 'rm -f "$PREFIX/.installing"' EXIT
# --no-save: no package.json or lock file written; quiet: no audit, fund or update notices, errors only
npm install --prefix "$PREFIX" --no-save --no-audit --no-fund --no-update-notifier --loglevel=error $PACKAGES >/dev/null
echo "$PACKAGES" > "$PREFIX/.installed"
