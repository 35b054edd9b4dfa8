"""tests/gpu_check.sh on a machine without CUDA: it checks its arguments, says so and exits 0 (CI runs it so)."""
import json
import os
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "gpu_check.sh")


def check(tmp_path, *args):
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env={**os.environ, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the whole GPU check (minutes)")
def test_without_cuda_it_checks_its_arguments_and_exits_0(tmp_path):
    r = check(tmp_path, "--steps=7")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cuda"] is False and summary["steps"] == 7
    assert json.loads(r.stdout.strip().splitlines()[-1]) == summary  # the summary is printed last
    bad = check(tmp_path, "--stepz=7")
    assert bad.returncode == 2 and "unknown argument --stepz=7" in bad.stderr
