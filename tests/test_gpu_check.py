"""tests/gpu_check.sh on a machine without CUDA: it checks its arguments, says so and exits 0; with --cpu it runs its
CPU-runnable steps for real (the API probe, the model's making, the single-process and torchrun runs, the summary)."""
import json
import os
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "gpu_check.sh")


def check(tmp_path, *args):
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env={**os.environ, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the whole GPU check (minutes)")
def test_without_cuda_it_checks_its_arguments_and_exits_0(tmp_path):
    r = check(tmp_path, "--steps=7")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cuda"] is False and summary["steps"] == 7
    assert json.loads(r.stdout.strip().splitlines()[-1]) == summary  # the summary is printed last
    bad = check(tmp_path, "--stepz=7")
    assert bad.returncode == 2 and "unknown argument --stepz=7" in bad.stderr


def test_with_cpu_it_runs_its_steps_for_real_and_summarises_them(tmp_path):
    r = check(tmp_path, "--cpu", "--steps=3", "--run_timeout=300")
    assert r.returncode == 0, r.stderr + (tmp_path / "gpu_check.log").read_text()[-3000:]
    summary = json.loads(r.stdout)  # the summary, printed last
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["cuda"] is False and summary["apis"]["fsdp.fully_shard"] is True
    for run in ("single", "torchrun"):  # (b) python train.py, (c) torchrun with one rank
        d = summary[run]
        assert d["exit"] == "0" and d["steps"] == 3, (run, d, (tmp_path / "gpu_check.log").read_text()[-3000:])
        assert d["step_s"] > 0 and d["trainer_tok_s"] > 0 and d["tokens_per_step"] > 0
        assert d["staleness_max"] <= 1
    assert summary["trainer_bench"]["tokens_per_s"] > 0 and summary["trainer_bench"]["grad_norm"] > 0
