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
