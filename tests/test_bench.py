import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def test_step_time_parts_are_logged_and_fit_in_the_step(tmp_path):
    """bench.py fixed splits time/step into train, weight_sync, handout, wait_rollout and the rest: each part is
    logged every step, none is negative, and together they account for the step. The hand-out is what is left before
    the training (less the wait) and the step less the parts what is left after it: ~1 ms and ~0.1 ms; a part that
    missed a piece of its work (a training timed from too late, a wait outside the sync) leaves it in these."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"),
           f"--out_dir={tmp_path}", "--prompts_per_step=2", "--max_steps=3", "--ckpt_every=0", "--dump_every=0"]
    p = subprocess.run(cmd, env=ENV, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    ms = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(ms) == 3
    assert all(m["memory/peak_mb"] > 100 for m in ms)  # bench.py checkpointing's (a torch trainer is larger)
    parts = ("time/train", "time/weight_sync", "time/handout", "time/wait_rollout")
    for m in ms:
        assert all(m[k] >= 0 for k in parts), {k: m[k] for k in parts}
        rest = m["time/step"] - sum(m[k] for k in parts)
        assert -1e-6 <= rest and rest + m["time/handout"] < 0.02 + 0.3 * m["time/train"], {k: m[k] for k in m
                                                                                           if k.startswith("time/")}


JOB = """
import json, os, sys
out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--out_dir="))
open(os.path.join(out, "metrics.jsonl"), "w").write(json.dumps({"env": os.environ.get("OMP_WAIT_POLICY")}) + "\\n")
"""


def test_bench_runs_each_job_in_the_callers_environment_not_what_train_py_sets_for_itself(tmp_path):
    """tools/bench.py imports train (its tiny init), which sets OMP_WAIT_POLICY=PASSIVE for its own process before torch
    loads; a peer (TRL) must not inherit that: under PASSIVE TRL's tiny step took twice as long (issue #32)."""
    (tmp_path / "job.py").write_text(JOB)
    for given in (None, "ACTIVE"):
        env = {k: v for k, v in ENV.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": given} if given else {})
        code = f"import bench; print(bench.run_train([], cmd=({sys.executable!r}, {str(tmp_path / 'job.py')!r})))"
        p = subprocess.run([sys.executable, "-c", code], env=env, cwd=os.path.join(ROOT, "tools"), capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.strip().splitlines()[-1] == repr([{"env": given}]), p.stdout


def test_the_trainer_benchmark_times_train_step_and_reports_prime_rls_units():
    """tools/bench.py trainer: train.train_step on synthetic sequences (one GPU: tests/gpu_check.sh at 16k tokens on
    a Qwen3-0.6B shape); here a small shape on CPU, with a given peak so that MFU is computed."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench.py"), "trainer", "--model=small", "--seq_len=128",
           "--steps=2", "--warmup=1", "--dtype=float32", "--peak_tflops=1"]
    p = subprocess.run(cmd, env=ENV, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    *table, last = p.stdout.strip().splitlines()
    result = json.loads(last)
    import torch
    from model_moe import ModelConfig, Transformer
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from bench import SHAPES
    small = Transformer(ModelConfig(**SHAPES["small"]))
    assert result["params"] == sum(p.numel() for p in small.parameters())  # the model it built, counted once (tied)
    assert result["tokens_per_s"] > 0 and result["step_s"] > 0 and result["peak_mem_gib"] > 0.1
    flops = 6 * result["params"] + 6 * 2 * 4 * 16 * 128  # + L heads head_dim T
    assert abs(result["mfu"] - result["tokens_per_s"] * flops / 1e12) < 1e-12
    assert table[-2].startswith("Type | SeqLen") and table[-1].startswith("RL Full | 128 | Recompute")
    assert 0 < result["grad_norm"] < float("inf")  # a real update: loss, backward, AdamW
    assert torch.isfinite(torch.tensor(result["tokens_per_s"]))
