#!/usr/bin/env bash
# The GPU path in one device call of at most 8 minutes (issue 21), run from the repository root:
#   OUT=/some/dir bash tests/gpu_check.sh [--steps=N] [--run_timeout=SECONDS]
# (a) tests/test_gpu.py (engine on CUDA, bf16 step with fp32 master weights, mismatch/* in bf16 with activation
#     checkpointing and compile, cpu_offload, Qwen3-VL(-MoE) against transformers, the image recipe in bf16);
# (b) train.py for --steps steps on a Qwen3-0.6B-shaped model initialised at random (no download; the tiny
#     tokenizer's 384 ids are a subset of the 151,936-token vocabulary), one GPU, the embedded engine, bf16, its
#     weights published GPU to GPU (weight_sync_share_of_step);
# (c) the same run under `torchrun --standalone --nproc_per_node=1` (the NCCL code path with one rank);
# (d) tools/bench.py trainer: train_step alone at 16k tokens, prime-rl's trainer benchmark's shape and units;
# (e) where an SGLang interpreter is (NANOMOLT_SGLANG_PYTHON, or the Dockerfile's /opt/sglang), the SGLang tests on
#     the GPU and (b) with --engine=sglang (one GPU: the server beside the trainer; two: on GPU 1, NCCL weight sync);
#     the lent machines have no SGLang (and no network), so there it says so and skips (then 8 minutes at most).
# Writes $OUT/summary.json and $OUT/gpu_check.log and prints the summary last. Without CUDA it checks its
# arguments, says so and exits 0. --cpu runs what a CPU can of it for real, on a small model of the same family in
# float32: the API probe, the model's making, (b), (c) and the summary (CI runs it so: tests/test_gpu_check.py).
set -u
steps=30 run_timeout=150 cpu=0
for arg in "$@"; do
  case "$arg" in
    --steps=[0-9]*) steps=${arg#*=} ;;
    --run_timeout=[0-9]*) run_timeout=${arg#*=} ;;
    --cpu) cpu=1 ;;
    *) echo "gpu_check.sh: unknown argument $arg (usage: [--steps=N] [--run_timeout=SECONDS] [--cpu])" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
log=$OUT/gpu_check.log
if [ $cpu = 0 ] && ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  printf '{"cuda": false, "steps": %s, "run_timeout": %s, "note": "no CUDA: arguments checked, nothing run"}\n' \
    "$steps" "$run_timeout" > "$OUT/summary.json"
  echo "gpu_check.sh: no CUDA device; arguments checked (steps=$steps, run_timeout=$run_timeout), nothing run"
  cat "$OUT/summary.json"
  exit 0
fi
work=$(mktemp -d)  # the 0.6B checkpoints stay out of $OUT (which comes back over the network)
model=$work/qwen3-0.6b-random
exec 3>&1 >"$log" 2>&1  # everything below goes to the log; the summary goes to fd 3 too

echo "== versions and the APIs the code needs (torch 2.11 on the device)"
python - "$OUT/apis.json" <<'EOF'
import json, sys, torch, transformers
import torch.nn.functional as F
apis = {"F.grouped_mm": hasattr(F, "grouped_mm"), "F.rms_norm": hasattr(F, "rms_norm"),
        "Tensor.nextafter": hasattr(torch.Tensor, "nextafter"),
        "sdpa enable_gqa": "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")}
for name, mod, attr in [("fsdp.fully_shard", "torch.distributed.fsdp", "fully_shard"),
                        ("fsdp.MixedPrecisionPolicy", "torch.distributed.fsdp", "MixedPrecisionPolicy"),
                        ("dcp state dict", "torch.distributed.checkpoint.state_dict", "get_model_state_dict")]:
    try:
        apis[name] = hasattr(__import__(mod, fromlist=[attr]), attr)
    except ImportError as e:
        apis[name] = f"ImportError: {e}"
dev = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.randn(64, 32, device=dev, dtype=torch.bfloat16)
w = torch.randn(4, 16, 32, device=dev, dtype=torch.bfloat16)
for dt in (torch.bfloat16, torch.float32):  # the MoE's training path, in both dtypes the trainer uses
    try:
        F.grouped_mm(x.to(dt), w.to(dt).mT, offs=torch.tensor([16, 32, 48, 64], device=dev, dtype=torch.int32))
        apis[f"grouped_mm {dt}"] = True
    except (RuntimeError, AttributeError) as e:
        apis[f"grouped_mm {dt}"] = str(e)[:200]
gpu = torch.cuda.get_device_name() if dev == "cuda" else "none (--cpu)"
info = {"torch": torch.__version__, "transformers": transformers.__version__, "gpu": gpu, "apis": apis}
print(json.dumps(info, indent=1))
json.dump(info, open(sys.argv[1], "w"))
EOF

if [ $cpu = 0 ]; then
  echo "== (a) tests/test_gpu.py"
  timeout 330 python -m pytest -q tests/test_gpu.py --junitxml="$OUT/test_gpu.xml"
  echo "pytest exit $?"
fi

echo "== the model: Qwen3-0.6B's shapes, random weights, the tiny tokenizer beside them"
python - "$model" "$cpu" <<'EOF'
import sys
import torch
import agent
from model_moe import ModelConfig, Transformer
shape = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128)
if sys.argv[2] == "1":  # --cpu: the same family, small
    shape = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
c = ModelConfig(**shape, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=40960)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # 0.6B parameters initialise faster on a GPU
    m = Transformer(c).init_weights(0)
m.save_pretrained(sys.argv[1])
agent.make_tokenizer(sys.argv[1])  # train.build_model loads the tokenizer from the model directory
EOF

# the run: the GPU recipe's algorithm on the guess task, bf16, short turns so ~30 steps fit in a couple of minutes
args=(--config configs/qwen3_0p6b_gpu.py "--model=$model" --task=guess --dtype=bfloat16 "--max_steps=$steps"
      --max_new_tokens=32 --max_turns=2 --engine_max_len=512 --engine_slots=64 --group_size=8 --prompts_per_step=8
      --queue_size=16 --max_staleness=1 --ckpt_every=0 --dump_every=0)
[ $cpu = 1 ] && args+=(--dtype=float32 --engine_slots=16 --group_size=4 --prompts_per_step=2 --queue_size=4
                       --max_new_tokens=4 --engine_max_len=128 --eval_every=0)
for run in single torchrun; do
  echo "== ($([ $run = single ] && echo b || echo c)) $run"
  [ $cpu = 1 ] && sleep 0 &  # --cpu: no GPU memory to sample
  [ $cpu = 0 ] && python - "$OUT/gpu_mem_$run.txt" <<'EOF' &
import subprocess, sys, time  # GPU memory of each process every 0.5 s, its role from its command line
with open(sys.argv[1], "w") as f:
    while True:
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True).stdout
        tot = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout.split()
        for line in q.strip().splitlines():
            pid, mib = (s.strip() for s in line.split(","))
            try:
                cmd = open(f"/proc/{pid}/cmdline").read()
            except OSError:
                cmd = ""
            f.write(f"{'engine' if 'spawn_main' in cmd else 'trainer' if 'train.py' in cmd else 'other'} {mib}\n")
        f.write(f"total {tot[0] if tot else 0}\n")
        f.flush()
        time.sleep(0.5)
EOF
  sampler=$!
  launch=(python)
  [ $run = torchrun ] && launch=(torchrun --standalone --nproc_per_node=1)
  timeout "$run_timeout" "${launch[@]}" train.py "${args[@]}" "--out_dir=$work/$run"
  echo "$run exit $?" | tee "$OUT/rc_$run.txt"
  kill "$sampler"
  cp "$work/$run/metrics.jsonl" "$OUT/metrics_$run.jsonl" 2>/dev/null
done

echo "== (e) SGLang on the GPU, where an SGLang interpreter is (NANOMOLT_SGLANG_PYTHON, or the Dockerfile's)"
sgl=${NANOMOLT_SGLANG_PYTHON:-/opt/sglang/bin/python}
if [ -x "$sgl" ] && "$sgl" -c "import sglang" 2>/dev/null; then
  export NANOMOLT_SGLANG_PYTHON=$sgl
  [ $cpu = 0 ] && timeout 330 python -m pytest -q tests/test_servers.py -k "sglang and cuda" --junitxml="$OUT/test_sglang.xml"
  # one GPU: the server beside the trainer on a share of its memory, weights from disk (NCCL takes no two ranks
  # on one device); two or more: the server on GPU 1, weights broadcast over NCCL
  ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
  sargs=(--engine=sglang "--server_python=$sgl" --server_timeout=300 --weight_sync=disk
         "--server_args=--mem-fraction-static 0.3 --attention-backend triton")
  [ "$ngpu" -ge 2 ] && sargs+=(--weight_sync=nccl "--server_args=--base-gpu-id 1 --attention-backend triton")
  [ $cpu = 1 ] && sargs+=(--weight_sync=gloo "--server_args=--device cpu --attention-backend torch_native \
--disable-cuda-graph --skip-server-warmup --max-total-tokens 4096")
  [ $cpu = 1 ] && export SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=$PWD/tests/sglang_cpu
  timeout "$run_timeout" python train.py "${args[@]}" "${sargs[@]}" "--out_dir=$work/sglang"
  echo "sglang exit $?" | tee "$OUT/rc_sglang.txt"
  cp "$work/sglang/metrics.jsonl" "$OUT/metrics_sglang.jsonl" 2>/dev/null
else
  echo "no SGLang interpreter at $sgl: skipped (the lent machines have none, and no network to install one)"
fi

echo "== (d) the trainer alone, as prime-rl's trainer benchmark (tools/bench.py trainer)"
bench=(--seq_len=16384 --steps=5 --warmup=2)
[ $cpu = 1 ] && bench=(--seq_len=256 --steps=1 --warmup=1 --dtype=float32)
timeout 150 python tools/bench.py trainer "--model=$model" "${bench[@]}" | tee /dev/stderr | tail -1 > "$OUT/trainer.json"
echo "trainer bench exit ${PIPESTATUS[0]}"

echo "== summary"
python - "$OUT" "$model" <<'EOF' | tee "$OUT/summary.json" >&3
import json, os, statistics, sys, xml.etree.ElementTree as ET
out, model = sys.argv[1:]
c = json.load(open(os.path.join(model, "config.json")))
H, L, V, I = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
nq, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
# matmul parameters a trained token runs through (the vocabulary projection too: train.py computes logits only
# at trained positions); the rest of the forward (prompt tokens, attention scores) is left out: a lower bound
n_mm = L * (H * hd * (2 * nq + 2 * nkv) + 3 * H * I) + V * H
info = json.load(open(os.path.join(out, "apis.json")))
peak = next((p for name, p in {"H200": 989e12, "H100": 989e12, "A100": 312e12}.items() if name in info["gpu"]), None)
s = {"cuda": info["gpu"] != "none (--cpu)", **info, "peak_bf16_flops": peak, "matmul_params": n_mm}
try:
    r = ET.parse(os.path.join(out, "test_gpu.xml")).getroot()
    r = r if r.tag == "testsuite" else r[0]
    s["tests"] = {k: int(r.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except (OSError, ET.ParseError) as e:
    s["tests"] = f"no junit report: {e}"
for run in ("single", "torchrun", "sglang"):
    if not os.path.exists(os.path.join(out, f"rc_{run}.txt")):  # (e) skipped: no SGLang
        continue
    d = {"exit": open(os.path.join(out, f"rc_{run}.txt")).read().split()[-1]}
    try:
        ms = [json.loads(line) for line in open(os.path.join(out, f"metrics_{run}.jsonl"))]
    except OSError:
        ms = []
    warm = ms[5:] or ms  # after compilation, allocation and the first weight copies
    med = lambda k: statistics.median(m[k] for m in warm if m.get(k) is not None) if warm else None
    mm = [m["mismatch/logprob_abs_diff"] for m in ms if m["mismatch/logprob_abs_diff"] is not None]
    d.update(steps=len(ms), step_s=med("time/step"), wait_s=med("time/wait_rollout"), train_s=med("time/train"),
             weight_sync_s=med("time/weight_sync"), engine_tok_s=med("throughput/rollout_tokens_per_s"),
             trainer_tok_s=med("throughput/train_tokens_per_s"), tokens_per_step=med("tokens/trained"),
             mismatch_abs_diff_median=statistics.median(mm) if mm else None,
             mismatch_abs_diff_max=max(mm, default=None),
             mismatch_kl_median=med("mismatch/kl"), staleness_mean=med("staleness/mean"),
             staleness_max=max((m["staleness/max"] for m in ms), default=None))
    if d["weight_sync_s"] is not None and d["step_s"]:  # the publish, GPU to GPU (CUDA IPC): issue 58 asks < 5%
        d["weight_sync_share_of_step"] = d["weight_sync_s"] / d["step_s"]
    if d["trainer_tok_s"] and peak:
        d["mfu_trained_tokens"] = 6 * n_mm * d["trainer_tok_s"] / peak
    peaks, mem = {}, os.path.join(out, f"gpu_mem_{run}.txt")
    for line in open(mem) if os.path.exists(mem) else ():
        role, mib = line.split()
        peaks[role] = max(peaks.get(role, 0), int(float(mib)))
    d["peak_gpu_mem_mib"] = peaks
    s[run] = d
try:
    s["trainer_bench"] = json.load(open(os.path.join(out, "trainer.json")))
except (OSError, ValueError) as e:
    s["trainer_bench"] = f"no result: {e}"
print(json.dumps(s, indent=1))
EOF
rm -rf "$work"
