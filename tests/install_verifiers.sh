#!/usr/bin/env bash
# Install verifiers 0.4.0 (prime-rl's environment library) in its own venv (.venv-verifiers at the repo root, ignored
# by git): it pins openai<3, this project openai 3. agents/verifiers_env.py runs its worker with this interpreter.
# uv comes along: verifiers' chat harness runs as a uv script, whose environment is prepared here once, so no episode
# downloads a package (each worker's first episode still has uv check the index: it needs PyPI reachable). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-verifiers
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import verifiers.v1, uv" 2>/dev/null \
    && [ -f "$VENV/.chat-harness-ready" ]; then
  echo "verifiers already installed in $VENV"; exit 0
fi
python -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q verifiers==0.4.0 uv==0.13.10
# the `null` harness's program (openai, mcp, httpx, ...) in uv's cache, as verifiers prepares it on first use
PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/python" - <<'PY'
import asyncio
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import SubprocessConfig, provision_runtime

async def main():
    async with provision_runtime(SubprocessConfig()) as runtime:
        await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE)

asyncio.run(main())
PY
touch "$VENV/.chat-harness-ready"
"$VENV/bin/python" -c "import verifiers; print('verifiers', verifiers.__version__, 'in', '$VENV')"
