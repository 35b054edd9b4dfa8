#!/usr/bin/env bash
# Install SGLang in its own venv (.venv-sglang at the repo root, ignored by git), so its pins (torch 2.14.1,
# transformers 5.19.0) never touch ours. tests/test_servers.py runs the server with this interpreter. Idempotent.
# On CPU: sglang's kernel packages are CUDA-only, so they are left out; tests/sglang_cpu/ stands in for the two
# sgl_kernel ops the CPU engine imports (the tests put it on the server's PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-sglang
PY="$VENV/bin/python"
if [ -x "$PY" ] && "$PY" -c "import sglang" 2>/dev/null && [ -f "$VENV/.nanomolt-patched" ]; then
  echo "sglang already installed in $VENV"; exit 0
fi
python -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip packaging
# a CUDA build of torch (the one sglang pins); it runs on CPU too and brings triton, which sglang imports
"$VENV/bin/pip" install -q torch==2.14.1
"$VENV/bin/pip" install -q --no-deps sglang==0.5.23 torchvision==0.29.1
# sglang's own dependencies minus the CUDA-only kernels and the unneeded media packages
DEPS=$("$PY" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"flashinfer-python", "flash-attn-4", "nvidia-cutlass-dsl", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla",
        "tilelang", "quack-kernels", "humming-kernels", "nvshmem4py-cu13", "sglang-kernel", "torch-memory-saver",
        "timm", "torchaudio", "torchcodec", "torchvision", "torch"}
for line in requires("sglang"):
    r = Requirement(line)
    if r.name.lower().replace("_", "-") not in skip and (r.marker is None or r.marker.evaluate({"extra": ""})):
        print(str(r).split(";")[0].replace(" ", ""))
PY
)
# shellcheck disable=SC2086
"$VENV/bin/pip" install -q torch==2.14.1 $DEPS
# --enable-return-routed-experts on CPU: sglang allocates the routed-experts host buffer with CUDA host
# registration whatever the device (ALLOC_MEMORY_FUNCS has no "cpu" entry); give "cpu" a plain allocation
"$PY" - <<'PY'
import sglang.srt.mem_cache.pool_host.common as m
src = open(m.__file__).read()
old = '"xpu": alloc_with_pin_memory_xpu,'
new = old + ('\n        "cpu": lambda dims, dtype, device, *a, **k: '
             'torch.empty(dims, dtype=dtype, device=device),  # nanomolt')
if "# nanomolt" not in src:
    assert old in src, "sglang changed: revisit the routed-experts CPU patch in tests/install_sglang.sh"
    open(m.__file__, "w").write(src.replace(old, new))
PY
touch "$VENV/.nanomolt-patched"
"$PY" -c "import sglang; print('sglang', sglang.__version__, 'in', '$VENV')"
