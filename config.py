"""config.py: every knob of a run, in one flat dataclass. `--config configs/x.py` (assignments) is read first, then
`--key=value` overrides; `--help` lists every field. Unknown keys, wrong types, impossible combinations fail, named."""
import ast
import contextlib
import re
import runpy
import sys
import types
from dataclasses import dataclass, fields


@dataclass
class Config:
    # ---- run ----
    out_dir: str = "out/default"  # where metrics.jsonl, episodes and checkpoints go
    seed: int = 0  # seeds the model init, the sampler and the tasks
    max_steps: int = 100  # optimizer steps to run
    resume: bool = False  # continue from the latest checkpoint in out_dir
    overwrite: bool = False  # start afresh in an out_dir that holds an earlier run, deleting its files
    ckpt_every: int = 50  # write a checkpoint every N steps (and at the end); 0 = only at the end
    dump_every: int = 10  # dump a few full episodes (decoded text, masks, reward) every N steps
    rollout_dump: bool = False  # save every trained batch (all its tensors) to <out_dir>/rollouts/step_N.pt
    replay: str = ""  # train on the batches of a rollout_dump directory instead of generating (no engine)
    # ---- model ----
    model: str = "tiny"  # HF dir (Qwen3, Qwen3-MoE, Llama, Qwen2), a .gguf file, or "tiny": a small MoE from scratch
    dtype: str = "float32"  # compute dtype (trainer and engine): float32 or bfloat16; master weights stay float32
    reshard_after_forward: str = "auto"  # FSDP2: free gathered weights after forward (true, false; auto: on GPUs)
    cpu_threads: int = 0  # CPU: each trainer rank's torch threads; 0 = cores // (ranks + 1), one share to the rollout
    compile: bool = False  # torch.compile the trained models' forward (policy, critic; MoE layers eager)
    activation_checkpointing: bool = False  # recompute each decoder block in backward: less memory, more compute
    cpu_offload: bool = False  # FSDP2 (GPUs): parameters, gradients, optimizer state in CPU memory between uses
    tiny_layers: int = 4  # tiny model: decoder layers
    tiny_hidden: int = 128  # tiny model: width
    tiny_experts: int = 8  # tiny model: experts per MoE layer (0 = dense)
    tiny_top_k: int = 2  # tiny model: experts per token
    tiny_vision: bool = False  # tiny model: a Qwen3-VL-MoE, with a vision tower (for image tasks; count sets it)
    image_size: int = 16  # image tasks: height = width of every image, in pixels (tiny vision: what it takes)
    patch_size: int = 4  # tiny vision: patch side; an image is (image_size / patch_size / 2)^2 <|image_pad|> tokens
    # ---- generation ----
    engine: str = "torch"  # torch: the embedded engine (CPU or GPU); vllm | sglang: inference servers over HTTP
    engine_slots: int = 64  # rows decoded together by the torch engine (continuous batching)
    engine_max_len: int = 256  # longest conversation (tokens) the torch engine holds per slot
    max_new_tokens: int = 8  # per model turn
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling
    top_k: int = 0  # top-k sampling; 0 = off
    server_urls: str = ""  # comma-separated URLs of running servers; empty = start one locally
    server_python: str = ""  # interpreter that runs the server (its own venv); empty = this one
    server_timeout: float = 600.0  # seconds to wait for a server to become healthy (and for one request)
    server_args: str = ""  # extra command-line arguments for a server started here, e.g. "--enforce-eager"
    weight_sync: str = "gloo"  # sglang: weights in memory over gloo (CPU servers) or nccl (GPU ones), or disk
    # ---- agents and tasks ----
    task: str = "guess"  # an agent file: a name in agents/ (guess, calc, arith, count) or a path/to/agent.py
    task_file: str = ""  # JSONL, one JSON object per prompt, merged into the task dict (e.g. {"a": 3, "b": 4})
    group_size: int = 8  # episodes per prompt (the GRPO group)
    prompts_per_step: int = 8  # prompts per optimizer step; batch = prompts_per_step * group_size episodes
    max_turns: int = 3  # model turns per episode in multi-turn tasks
    guess_max: int = 7  # guess task: the secret is in 1..guess_max
    arith_prompt: str = "{a}+{b}="  # arith task: the question, formatted with the task dict
    concurrent_agents: int = 64  # agents running at once in the rollout process
    episode_timeout: float = 120.0  # seconds before an agent is cancelled and its episode dropped
    max_failed_groups: int = 20  # stop the run after this many groups in a row whose every episode failed
    tool_timeout: float = 5.0  # seconds of wall time for one tool call
    tool_memory_mb: int = 256  # address-space limit of a tool call, and its quota of bytes written
    sandbox_unsafe: bool = False  # run tools even where a wall of the sandbox is missing: trusted code only
    # ---- algorithm ----
    advantage: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | batch_mean | opd | gae
    critic: str = ""  # gae: the value model's HF directory (a scalar head on its last hidden state); empty = model's
    critic_lr: float = 1e-3  # gae: the critic's AdamW learning rate
    gae_gamma: float = 1.0  # gae: discount per sampled token
    gae_lambda: float = 0.95  # gae: lambda of GAE (1: return - value; 0: one-token TD)
    value_clip: float = 0.2  # gae: the value loss keeps new values within old +- value_clip (with several updates)
    teacher: str = ""  # opd (on-policy distillation): the frozen teacher's HF directory (the student's tokenizer)
    opd_reward_coef: float = 0.0  # opd: weight of the task reward's GRPO advantage beside the teacher's
    filter_groups: bool = False  # drop groups whose rewards are all equal and take others (DAPO dynamic sampling)
    max_filtered_groups: int = 1000  # filter_groups: stop the run after this many groups in a row filtered out
    policy_loss: str = "ppo"  # ppo | gspo | cispo
    clip_low: float = 0.2  # ratio clip below 1
    clip_high: float = 0.28  # ratio clip above 1 (clip-higher)
    dual_clip: float = 0.0  # dual-clip bound c for negative advantages; 0 = off
    correction: str = "tis"  # train-vs-rollout correction: none | tis | mis | seq_mis
    correction_low: float = 0.5  # lower bound of the correction band (mis, seq_mis)
    correction_high: float = 2.0  # upper bound (truncation for tis)
    aggregation: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
    kl_coef: float = 0.0  # weight of the KL-to-reference loss (0 = no reference model)
    kl_estimator: str = "k3"  # k1 | k2 | k3
    entropy_coef: float = 0.0  # entropy bonus
    lora_rank: int = 0  # LoRA adapters of this rank on lora_targets, the rest frozen; 0 = full fine-tuning
    lora_alpha: float = 16.0  # LoRA: the adapters' update is scaled by lora_alpha / lora_rank
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"  # LoRA: linear layers' last names (MoE experts: refused)
    router_aux_coef: float = 0.0  # MoE load-balancing loss weight (Switch Transformer); keeps every expert in use
    lr: float = 1e-3  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    adam_eps: float = 1e-8  # AdamW epsilon: gradients much smaller than it get updates smaller than lr
    grad_clip: float = 1.0  # clip the global gradient norm (after reduction across ranks)
    micro_batch_tokens: int = 4096  # padded tokens per forward/backward (episodes sorted by length, little padding)
    mini_batches: int = 1  # optimizer updates per pass over a batch (PPO mini-batches, in data order)
    ppo_epochs: int = 1  # passes over each batch; more than one update makes the policy ratio and its clip matter
    max_staleness: int = 1  # max policy versions between sampling a token and training on it; 0 = on-policy
    queue_size: int = 32  # finished groups buffered between rollout and trainer (back-pressure beyond)
    deterministic: bool = False  # async, reproducibly: weights change between batches only; resume is exact
    stop_grace: float = 10.0  # deterministic: seconds after SIGTERM to let episodes end (then the resume is inexact)
    max_bad_steps: int = 3  # stop after this many steps in a row with a non-finite gradient norm (each skipped)
    # ---- evaluation and logging ----
    eval_every: int = 0  # evaluate on held-out prompts every N steps (metrics eval/... at that step); 0 = off
    eval_at_start: bool = False  # also evaluate the initial policy (step 0)
    eval_only: bool = False  # evaluate the model (or the latest checkpoint of out_dir) once and exit; no training
    eval_task: str = ""  # the evaluation's agent, as task; empty = task
    eval_file: str = ""  # held-out prompts (JSONL, as task_file); empty: the task's stream, disjoint from training's
    eval_prompts: int = 32  # prompts per evaluation
    eval_samples: int = 4  # k: episodes per prompt (pass@k, mean@k)
    eval_temperature: float = 1.0  # the evaluation's sampling temperature; 0 = greedy
    eval_top_p: float = 1.0  # the evaluation's nucleus sampling
    eval_max_new_tokens: int = 0  # the evaluation's tokens per model turn; 0 = max_new_tokens
    eval_pass_reward: float = 1.0  # an episode passes (pass@k) when its reward is at least this
    wandb_project: str = ""  # also stream each metrics line to this Weights & Biases project; empty = off
    wandb_run: str = ""  # the W&B run's name; empty = one W&B chooses

    def __post_init__(self):
        # ---- derived values and cross-field checks ----
        self.batch_size = self.group_size * self.prompts_per_step  # episodes per optimizer step
        # the engine reads the trainer's weights from shared memory (torch; sglang's broadcast); else from a directory
        self.weights_in_memory = self.engine == "torch" or (self.engine == "sglang" and self.weight_sync != "disk")
        self.tiny_vision |= self.task == "count"  # the image task needs the tower
        import estimators  # the variant names live beside the functions
        tables = {"engine": ("torch", "vllm", "sglang"), "weight_sync": ("gloo", "nccl", "disk"),
                  "dtype": ("float32", "bfloat16"), "reshard_after_forward": ("auto", "true", "false"),
                  "advantage": estimators.ADVANTAGES | {"opd": None, "gae": None}, "kl_estimator": estimators.KL,
                  "policy_loss": estimators.POLICY_LOSSES, "aggregation": estimators.AGGREGATIONS,
                  "correction": estimators.CORRECTIONS}
        checks = [
            *((key, getattr(self, key) in t, f"must be one of {', '.join(t)}") for key, t in tables.items()),
            ("tiny_top_k", self.tiny_experts == 0 or 1 <= self.tiny_top_k <= self.tiny_experts,
             f"must be in 1..tiny_experts ({self.tiny_experts})"),
            *((key, getattr(self, key) >= 0, "must be >= 0") for key in
              ("max_staleness", "lora_rank", "eval_every", "eval_temperature", "cpu_threads")),
            *((key, getattr(self, key) >= 1, "must be >= 1") for key in
              ("group_size", "prompts_per_step", "micro_batch_tokens", "ppo_epochs", "max_failed_groups", "max_turns",
               "eval_prompts", "eval_samples")),
            ("replay", not (self.replay and (self.eval_only or self.eval_at_start)), "has no engine to evaluate with"),
            ("eval_file", self.eval_file or not self.task_file
             or not (self.eval_every or self.eval_at_start or self.eval_only), "must be set with task_file"),
            ("mini_batches", 1 <= self.mini_batches <= self.batch_size, f"must be in 1..{self.batch_size}"),
            ("teacher", (self.advantage == "opd") == bool(self.teacher), "is given exactly when advantage=opd"),
            ("critic", self.advantage == "gae" or not self.critic, "is given only with advantage=gae"),
            *((key, 0 <= getattr(self, key) <= 1, "must be in [0, 1]") for key in ("gae_gamma", "gae_lambda")),
            ("replay", not (self.replay and self.rollout_dump), "and rollout_dump do not go together"),
            ("guess_max", 1 <= self.guess_max <= 9, "must be in 1..9 (a guess is one digit)"),
            ("patch_size", self.patch_size >= 1 and self.image_size % (2 * self.patch_size) == 0,
             "must divide image_size / 2 (the merger takes 2 x 2 patches)"),
            ("engine", self.engine != "vllm" or not self.tiny_vision, "vllm takes no images: torch or sglang do"),
            ("temperature", self.temperature > 0, "must be > 0 (the recorded logprobs need a sampling distribution)"),
            *((key, 0 < getattr(self, key) <= 1, "must be in (0, 1]") for key in ("top_p", "eval_top_p")),
            ("clip_low", 0 <= self.clip_low < 1, "must be in [0, 1)"),
            ("correction_low", self.correction_low < 1 < self.correction_high, "must be < 1 < correction_high"),
            ("queue_size", self.queue_size >= self.prompts_per_step, f"must be >= {self.prompts_per_step} (a batch)"),
        ]
        for key, ok, why in checks:
            if not ok:
                raise ValueError(f"config: {key}={getattr(self, key)!r} {why}")


def _coerce(key, value, typ, cli=False):
    """A config file's Python value, or (cli=True) a command-line string, as typ; a file's "10" is no int."""
    given = value
    if cli and typ is bool and value.lower() in ("1", "true", "yes", "0", "false", "no"):
        return value.lower() in ("1", "true", "yes")
    if cli and typ is not str:  # "12" -> 12, "3e-4" -> 0.0003
        with contextlib.suppress(ValueError, SyntaxError, TypeError):
            value = ast.literal_eval(value)
    # a bool is an int to isinstance, and an int is a float to the config
    if isinstance(value, bool) == (typ is bool) and isinstance(value, (int, float) if typ is float else typ):
        return typ(value)
    raise ValueError(f"config: {key}={given!r} is not a {typ.__name__}")


def read_file(path, types_):
    """A config file's assignments (names without a leading underscore, modules aside), each checked."""
    if not path:
        raise ValueError("config: --config needs a path (--config configs/x.py)")
    scope = {k: v for k, v in runpy.run_path(path).items() if k[0] != "_" and not isinstance(v, types.ModuleType)}
    if unknown := next((k for k in scope if k not in types_), None):
        raise ValueError(f"config: unknown key {unknown!r} in {path}")
    return {k: _coerce(k, v, types_[k]) for k, v in scope.items()}


def load(argv=None):
    """Parse `[--config file.py] [--key=value ...]` into a validated Config."""
    argv = sys.argv[1:] if argv is None else argv
    types_ = {f.name: f.type for f in fields(Config)}
    if "--help" in argv or "-h" in argv:
        docs = dict(re.findall(r"^    (\w+): \w+ = .*?  # (.*)$", open(__file__).read(), re.M))  # each field's comment
        print("usage: train.py [--config configs/x.py] [--key=value ...]\n")
        print("\n".join(f"  --{f.name}={f.default!r:<14} {docs.get(f.name, '')}" for f in fields(Config)))
        sys.exit(0)
    values, overrides = {}, []  # from --config files; from --key=value, as given
    args = iter(argv)
    for arg in args:
        key, eq, value = arg[2:].partition("=")
        if not arg.startswith("--"):
            raise ValueError(f"config: unexpected argument {arg!r} (use --key=value)")
        if key == "config":
            values |= read_file(value if eq else next(args, ""), types_)
        elif key not in types_:
            raise ValueError(f"config: unknown key {key!r} (see --help)")
        else:
            overrides.append((key, value if eq else "true"))  # a bare flag: --resume
    return Config(**values | {k: _coerce(k, v, types_[k], cli=True) for k, v in overrides})  # the command line wins
