"""Many machines (README): the trainer as two torchrun "nodes" on this host, two launchers and one rendezvous, as a
run on two machines starts; it must be the run one process makes on the same batches."""
import os
import signal
import socket
import subprocess
import sys
import time

from safetensors.torch import load_file

import config
import train
from test_train import ENV, ROOT, metrics

# a reward that varies within every group from the first step on (the untrained policy rarely finds the secret):
# each step has a policy gradient to compare, not only zeros
VARIED_AGENT = """
from agent import load_agent

guess = load_agent("guess")
async def run(task, llm):
    ep = await guess(task, llm)
    ep.reward = float(ep.info["invalid"] - ep.info["turns"])
    return ep
"""


def run_nodes(node_cmds, logs, timeout):
    """Start one launcher per node (each in its own process group) -> their exit codes. One that fails, or the
    deadline, kills the others with all their processes: a launcher left waiting for a dead peer never hangs a test."""
    procs = []
    for cmd, log in zip(node_cmds, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
            assert time.monotonic() < deadline, f"the nodes ran past {timeout}s"
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs]


def test_two_torchrun_nodes_train_as_one_process(tmp_path):
    """Node 0 holds global rank 0: the rollout process, the engine, out_dir. Node 1 gets another out_dir, as a machine
    without a shared filesystem would: it must read and write nothing there. One process then replays the batches the
    two nodes trained (their rollout_dump): its losses, gradient norms and weights are theirs, as for 2 FSDP ranks."""
    (tmp_path / "varied.py").write_text(VARIED_AGENT)
    init = train.tiny_init(config.load([f"--out_dir={tmp_path / 'init'}"]), 0, False)  # the model, on every node
    args = [os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "guess.py"), f"--model={init}",
            f"--task={tmp_path / 'varied.py'}", "--prompts_per_step=4", "--max_steps=3", "--max_staleness=0",
            "--router_aux_coef=0", "--eval_every=0", "--ckpt_every=0", "--dump_every=0"]  # (aux: micro-batches differ)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
            "--master_addr=127.0.0.1", f"--master_port={port}"]
    cmds = [node + [f"--node_rank={i}"] + args + [f"--out_dir={tmp_path / f'node{i}'}"] for i in (0, 1)]
    logs = [tmp_path / f"node{i}.log" for i in (0, 1)]
    codes = run_nodes([cmds[0] + ["--rollout_dump"], cmds[1]], logs, timeout=240)
    assert codes == [0, 0], "\n".join(f"{log}: {log.read_text()[-3000:]}" for log in logs)
    assert "(2 rank(s), cpu)" in logs[0].read_text()
    assert os.listdir(tmp_path / "node1") == []  # rank 1 wrote nothing to its out_dir (it could read nothing there)
    replay = [f"--out_dir={tmp_path / 'one'}", f"--replay={tmp_path / 'node0' / 'rollouts'}"]
    r = subprocess.run([sys.executable, *args, *replay], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    two, one = metrics(tmp_path / "node0"), metrics(tmp_path / "one")
    assert [m["step"] for m in two] == [m["step"] for m in one] == [1, 2, 3]
    for a, b in zip(two, one):  # FSDP sums in another order than one process: equal up to float rounding
        assert a["tokens/trained"] == b["tokens/trained"] > 0 and a["reward/std"] == b["reward/std"] > 0
        assert abs(a["loss/policy"] - b["loss/policy"]) < 1e-6 and abs(a["grad/norm"] - b["grad/norm"]) < 1e-5
        assert abs(a["loss/entropy"] - b["loss/entropy"]) < 1e-5
        # the replay scores each batch with its own weights against what the two nodes' engine sampled: at every
        # step its weights are the ones the nodes had (the whole run, not only the last step)
        assert a["mismatch/logprob_abs_diff"] < 1e-5 and b["mismatch/logprob_abs_diff"] < 1e-5
    w0, w2, w1 = (load_file(os.path.join(d, "model.safetensors")) for d in
                  (init, tmp_path / "node0" / "ckpt", tmp_path / "one" / "ckpt"))
    assert w2.keys() == w1.keys() and all((w2[k] - w1[k]).abs().max() <= 1e-5 for k in w2)
    assert max((w2[k] - w0[k]).abs().max() for k in w2) > 1e-3  # trained: 3 steps of lr 5e-4 moved the weights


def test_a_server_elsewhere_is_sent_weight_paths_it_can_open_from_its_own_working_directory(tmp_path):
    """Disk weight sync with --server_urls: the server (here a stand-in in this process, whose working directory is
    not the trainer's, as on another machine) opens the directory the trainer names; a relative out_dir named a
    path relative to the trainer's working directory, which the server looked for in its own."""
    from test_servers import FakeSGLang
    fake, cwd = FakeSGLang(384, layers=4, top_k=2), tmp_path / "trainer"  # the tiny model's vocabulary and routing
    cwd.mkdir()
    try:
        r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config",
                            os.path.join(ROOT, "configs", "guess.py"), "--out_dir=run", "--engine=sglang",
                            "--weight_sync=disk", f"--server_urls={fake.url}", "--max_steps=2", "--prompts_per_step=2",
                            "--max_staleness=0", "--eval_every=0"], env=ENV, cwd=cwd, capture_output=True, text=True,
                           timeout=240)
    finally:
        fake.close()
    paths = [b["model_path"] for b in fake.calls("/update_weights_from_disk")]
    assert r.returncode == 0, (paths, r.stderr[-3000:])
    assert paths[0] == str(cwd / "run" / "engine_weights" / "v0") and len(paths) >= 2, paths  # then newer versions
