import dataclasses
import glob
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from config import Config, load  # noqa: E402

FIELDS = dataclasses.fields(Config)


def write(tmp_path, text):
    path = tmp_path / "run.py"
    path.write_text(text)
    return str(path)


def test_defaults():
    cfg = load([])
    assert all(getattr(cfg, f.name) == f.default for f in FIELDS)
    assert cfg.batch_size == cfg.group_size * cfg.prompts_per_step


def test_file_then_command_line(tmp_path):
    path = write(tmp_path, "import math\nmax_steps = 2 ** 5\nseed = 3\ntask = 'calc'\nlr = 1\n"
                           "clip_high = math.sqrt(0.0784)\n")
    cfg = load(["--seed=7", "--config", path, "--task=arith"])  # the command line wins wherever it stands
    assert (cfg.max_steps, cfg.seed, cfg.task) == (32, 7, "arith")
    assert type(cfg.lr) is float and cfg.lr == 1.0  # an int in the file becomes a float
    assert cfg.clip_high == pytest.approx(0.28)
    assert load([f"--config={path}"]).seed == 3


@pytest.mark.parametrize("arg,want", [("--resume", True), ("--resume=true", True), ("--resume=1", True),
                                      ("--resume=false", False), ("--resume=0", False), ("--resume=False", False)])
def test_bool_flags(arg, want):
    assert load([arg]).resume is want


def test_command_line_types():
    cfg = load(["--max_steps=12", "--lr=3e-4", "--temperature=2", "--out_dir=out/x y", "--top_k=5"])
    assert (cfg.max_steps, cfg.lr, cfg.temperature, cfg.out_dir, cfg.top_k) == (12, 3e-4, 2.0, "out/x y", 5)
    assert type(cfg.max_steps) is int and type(cfg.temperature) is float


def assert_names(excinfo, key):
    msg = str(excinfo.value)
    assert re.search(rf"(^|\W){re.escape(key)}(\W|$)", msg.removeprefix("config:")), msg
    assert "\n" not in msg


@pytest.mark.parametrize("argv,key", [
    (["--nope=1"], "nope"), (["--max_steps=abc"], "max_steps"), (["--lr=fast"], "lr"),
    (["--max_steps=1.5"], "max_steps"), (["--resume=maybe"], "resume"), (["--seed=True"], "seed"),
    (["--tiny_top_k=9"], "tiny_top_k"), (["--tiny_experts=4", "--tiny_top_k=5"], "tiny_top_k"),
    (["--group_size=4", "--prompts_per_step=4", "--queue_size=3"], "queue_size"),
    (["--advantage=ppo"], "advantage"), (["--policy_loss=grpo"], "policy_loss"),
    (["--correction=magic"], "correction"), (["--aggregation=sum"], "aggregation"),
    (["--kl_estimator=k4"], "kl_estimator"), (["--engine=tgi"], "engine"),
    (["--temperature=0"], "temperature"), (["--temperature=-1"], "temperature"),
    (["--tiny_vision=true", "--engine=vllm"], "engine"), (["--guess_max=12"], "guess_max"),
    (["--config"], "--config"), (["stray"], "stray"),
])
def test_bad_command_line(argv, key):
    with pytest.raises(ValueError) as e:
        load(argv)
    assert_names(e, key)


@pytest.mark.parametrize("text,key", [
    ("nope = 1\n", "nope"), ("max_steps = '10'\n", "max_steps"), ("lr = 'fast'\n", "lr"),
    ("resume = 'true'\n", "resume"), ("out_dir = 5\n", "out_dir"), ("seed = 1.0\n", "seed"),
    ("tiny_experts = 2\ntiny_top_k = 3\n", "tiny_top_k"), ("engine = 'tgi'\n", "engine"),
])
def test_bad_file(tmp_path, text, key):
    with pytest.raises(ValueError) as e:
        load(["--config", write(tmp_path, text)])
    assert_names(e, key)


def test_boundaries_pass():  # the checks above reject exactly the impossible side
    assert load(["--tiny_top_k=8", "--queue_size=64"]).queue_size == 64
    assert load(["--tiny_experts=0", "--tiny_top_k=5"]).tiny_experts == 0  # dense: top_k unused


def field_docs():
    """The trailing comment of each field in config.py's source: what --help prints beside it."""
    return dict(re.findall(r"^    (\w+): \w+ = .*?  # (.*)$", (ROOT / "config.py").read_text(), re.M))


def test_every_field_has_a_one_line_doc():
    docs = field_docs()
    missing = [f.name for f in FIELDS if not docs.get(f.name)]
    assert not missing, missing


def test_help_lists_every_field():
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = field_docs()
    lines = {line.split("=")[0].strip(): line for line in out.stdout.splitlines() if line.strip().startswith("--")}
    for f in FIELDS:
        assert f"--{f.name}" in lines, f.name
        assert docs[f.name] in lines[f"--{f.name}"], f.name


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "configs" / "*.py"))))
def test_shipped_configs_load(path):
    assert isinstance(load(["--config", path]), Config)
