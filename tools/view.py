"""python tools/view.py OUT_DIR: a run on one static page, OUT_DIR/view.html, that opens from disk in a browser.

    python tools/view.py out/guess                        # -> out/guess/view.html
    python tools/view.py --compare out/base out/change    # both runs' curves overlaid -> out/base/view.html
    python tools/view.py out/guess --out /tmp/guess.html  # the page elsewhere

The page is self-contained (no server, no network): matplotlib draws the curves of metrics.jsonl as inline SVG, each
against the step and against wall time (the running sum of time/step); the dumped episodes (episodes.jsonl from the
training, eval/step_N.jsonl from the evaluations) are embedded as data and drawn by the page's own script, a group's
episodes side by side, every token with its role and, when the policy sampled it, a colour by the chosen quantity.
A run in progress shows what it has written so far; run the command again to refresh the page.
"""
import argparse
import glob
import html
import io
import json
import os
import re
from itertools import accumulate

import matplotlib

matplotlib.use("svg")  # no display: the figures become SVG text, inlined in the page
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.grid": True, "grid.alpha": 0.3})
# with several runs, a run is a colour and a key a line style (six: the step time's parts)
STYLES = ["-", "--", ":", "-.", (0, (6, 2, 1, 2, 1, 2)), (0, (1, 4))]
TIMES = ["time/step", "time/wait_rollout", "time/train", "time/weight_sync", "time/handout", "time/wait_eval"]


def panels(runs):
    """(title, keys, log scale) of each plot; pass@k plots whatever eval/pass@K keys the runs logged."""
    logged = {key for rows in runs.values() for m in rows for key in m}
    passes = sorted((k for k in logged if re.fullmatch(r"eval/pass@\d+", k)), key=lambda k: int(k.split("@")[1]))
    return [
        ("reward", ["reward/mean"], False),
        ("held-out pass@k", passes, False),
        ("policy loss", ["loss/policy"], False),
        ("entropy", ["loss/entropy"], False),
        ("KL to the reference", ["loss/kl_ref"], False),
        ("engine-trainer mismatch (log)", ["mismatch/logprob_abs_diff", "mismatch/kl"], True),
        ("staleness (steps)", ["staleness/mean", "staleness/max"], False),
        ("step time and its parts (s)", TIMES, False),
        ("throughput (tokens/s)", ["throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s"], False),
    ]


def read_jsonl(path):
    """The rows of a JSONL file ([] when it is missing); a half-written last line (a run in progress) is skipped."""
    rows = []
    if not os.path.exists(path):
        return rows
    for line in open(path):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def axis(rows, x):
    """Each row's x: its step, or ("wall") the seconds since the start, the running sum of time/step; an evaluation's
    own line has no time/step: it sits at the wall time of the step before it."""
    if x == "step":
        return [m["step"] for m in rows]
    return list(accumulate(m.get("time/step") or 0.0 for m in rows))


def series(rows, key, x, log):
    """(xs, ys): a key's numeric values against x (a null is no point; nor is 0 on a log axis, which cannot show it)."""
    xs, ys = [], []
    for at, m in zip(axis(rows, x), rows):
        value = m.get(key)
        if isinstance(value, (int, float)) and (value > 0 or not log):
            xs.append(at)
            ys.append(value)
    return xs, ys


def figure(runs, title, keys, log, x):
    """One plot as inline SVG text. One run: a colour per key; several: a colour per run, a line style per key."""
    fig, ax = plt.subplots(figsize=(4.8, 2.6))
    drawn = 0
    for r, (name, rows) in enumerate(runs.items()):
        for k, key in enumerate(keys):
            xs, ys = series(rows, key, x, log)
            drawn += len(xs)
            colour = f"C{r}" if len(runs) > 1 else f"C{k}"
            marker = "." if len(xs) <= 60 else None  # a few points are dots, a long run a line
            ax.plot(xs, ys, color=colour, ls=STYLES[k % len(STYLES)] if len(runs) > 1 else "-", marker=marker,
                    markersize=4, lw=1.3, gid=f"curve {key}", label=key)
    if drawn and log:
        ax.set_yscale("log")
    ends = [at for rows in runs.values() for at in axis(rows, x)]
    if ends and max(ends) > min(ends):  # every plot spans the whole run, even a key logged at a few steps only
        pad = 0.03 * (max(ends) - min(ends))
        ax.set_xlim(min(ends) - pad, max(ends) + pad)
    if not drawn:
        ax.text(0.5, 0.5, "nothing logged yet", ha="center", va="center", transform=ax.transAxes, color="grey")
    if len(runs) > 1:  # the legend names each run's dir by its colour, then each key by its line style
        handles = [Line2D([], [], color=f"C{r}", label=name) for r, name in enumerate(runs)]
        if len(keys) > 1:
            handles += [Line2D([], [], color="grey", ls=STYLES[k % len(STYLES)], label=key)
                        for k, key in enumerate(keys)]
        ax.legend(handles=handles, fontsize=7)
    elif len(keys) > 1 and drawn:
        ax.legend(fontsize=7)
    ax.set_title(title if len(keys) > 1 else keys[0])
    ax.set_xlabel("step" if x == "step" else "wall time (s)")
    if x == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # no XML prolog inside HTML


def curves(runs):
    """The HTML of every plot that has a logged key, each twice: against the step and against wall time."""
    parts = []
    for title, keys, log in panels(runs):
        present = [k for k in keys if any(k in m for rows in runs.values() for m in rows)]
        if not present:
            continue
        for x in ("step", "wall"):
            svg = figure(runs, title, present, log, x)
            parts.append(f'<div class="panel" data-x="{x}" data-keys="{" ".join(present)}">{svg}</div>')
    return "\n".join(parts)


def compact(row):
    """A dump row for the page: the text dropped where per-token pieces show it, logprobs rounded."""
    row = dict(row)
    if "pieces" in row:
        row.pop("text", None)
        row["logprobs"] = [round(v, 4) for v in row["logprobs"]]
    return row


def dumps(name, out_dir, several):
    """A run's dumps, by step, training before evaluation: [{label, kind, step, rows}]."""
    found = []
    rows = read_jsonl(os.path.join(out_dir, "episodes.jsonl"))
    for step in sorted({r["step"] for r in rows}):
        found.append(("train", step, [r for r in rows if r["step"] == step]))
    for path in glob.glob(os.path.join(out_dir, "eval", "step_*.jsonl")):
        step = int(re.search(r"step_(\d+)\.jsonl$", path).group(1))
        found.append(("eval", step, read_jsonl(path)))
    prefix = f"{name}: " if several else ""
    return [{"label": f"{prefix}{kind} step {step}", "kind": kind, "step": step, "rows": [compact(r) for r in rows]}
            for kind, step, rows in sorted(found, key=lambda f: (f[1], f[0] != "train"))]


def summary(name, rows, colour):
    """One line on a run: its dir (in its curves' colour), steps, wall time, the latest reward and pass@1."""
    steps = [m for m in rows if "reward/mean" in m]
    evals = [m for m in rows if "eval/pass@1" in m]
    parts = [f"{len(steps)} steps", f"{sum(m.get('time/step') or 0.0 for m in rows):.0f} s"]
    if steps:
        parts.append(f"reward/mean {steps[-1]['reward/mean']:.3f}")
    if evals:
        parts.append(f"eval/pass@1 {evals[-1]['eval/pass@1']:.3f} (step {evals[-1]['step']})")
    return f'<li><b style="color:{colour}">{html.escape(name)}</b>: {", ".join(parts)}</li>'


CSS = """
body { font: 14px system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 18px 0 6px; }
h3 { font-size: 14px; margin: 12px 0 4px; }
.bar { margin: 6px 0; } .bar select { margin-right: 12px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 6px; }
.panel svg { width: 100%; height: auto; }
body[data-x=step] .panel[data-x=wall], body[data-x=wall] .panel[data-x=step] { display: none; }
.cols { display: flex; gap: 6px; overflow-x: auto; align-items: flex-start; }
.episode { flex: 1 0 150px; max-width: 420px; border: 1px solid #ccc; border-radius: 4px; padding: 4px; }
.head { font-size: 12px; margin-bottom: 4px; } .head b { font-size: 13px; } .info { color: #666; }
.seg { font-size: 11px; color: #666; border-top: 1px dashed #bbb; margin-top: 4px; }
.tokens { font: 12px/1.55 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }
.tok.prompt { color: #8a8a8a; } .tok.env { color: #777; background: #ececec; }
.tok.sampled { color: #000; box-shadow: inset 0 0 0 1px #0002; } .tok.special { opacity: 0.45; }
.error { color: #b00; }
#scale { font-size: 12px; color: #444; }
"""

# The episodes' script: the dumps are the data above it; a token's colour says one chosen quantity
JS = r"""
const dumpSelect = document.getElementById("dump");
const bySelect = document.getElementById("by");
const SPECIAL = /^<\|[^|]*\|>$/;
const SCALES = {
  logprob: "engine probability exp(logprob): red 0 to green 1",
  staleness: "staleness, steps behind (training: step - 1 - version; eval: step - version): green 0 to red the most",
  advantage: "advantage: red negative, white 0, green positive (eval episodes have none: blank)",
};

function el(tag, cls, text) {
  const node = document.createElement(tag);
  node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(v) {
  return typeof v === "number" ? v.toFixed(3) : String(v);
}

// how many steps behind the policy that sampled a token was: a training step trains on version step - 1's tokens
function behind(dump, version) {
  return dump.step - version - (dump.kind === "train" ? 1 : 0);
}

// sampled token i of row -> its background colour, by the chosen quantity; most: the dump's largest staleness / |adv|
function colour(by, dump, row, i, most) {
  if (by === "logprob") return `hsl(${120 * Math.exp(row.logprobs[i])}, 80%, 75%)`;
  if (by === "staleness") {
    const stale = behind(dump, row.versions[i]) / Math.max(most.staleness, 1);
    return `hsl(${120 * (1 - Math.min(stale, 1))}, 80%, 75%)`;
  }
  if (typeof row.advantage !== "number") return "#fff";
  const a = row.advantage / Math.max(most.advantage, 1e-9);
  return `hsl(${a < 0 ? 0 : 120}, 80%, ${97 - 25 * Math.abs(a)}%)`;
}

// the largest staleness and |advantage| in a dump: the far ends of their colour scales
function extremes(dump) {
  const most = {staleness: 0, advantage: 0};
  for (const row of dump.rows) {
    if (typeof row.advantage === "number") most.advantage = Math.max(most.advantage, Math.abs(row.advantage));
    (row.versions || []).forEach((v, i) => {
      if (row.mask[i] === 1) most.staleness = Math.max(most.staleness, behind(dump, v));
    });
  }
  return most;
}

// an episode's tokens: prompt (mask 0 before the first sampled token), environment (mask 0 after it), sampled
function tokens(by, dump, row, most) {
  const box = el("div", "tokens");
  if (!row.pieces) {  // an older dump: the text only
    box.textContent = row.text;
    return box;
  }
  const first = row.mask.indexOf(1);
  row.pieces.forEach((piece, i) => {
    const sampled = row.mask[i] === 1;
    let role = "env";
    if (sampled) role = "sampled";
    else if (first < 0 || i < first) role = "prompt";
    const span = el("span", "tok " + role, piece.replaceAll("\n", "\u21b5\n"));
    if (SPECIAL.test(piece)) span.classList.add("special");
    span.title = `${role} token ${i}: id ${row.ids[i]}, text ${JSON.stringify(piece)}, ` +
      `logprob ${row.logprobs[i].toFixed(4)}, version ${row.versions[i]}`;
    if (sampled) span.style.background = colour(by, dump, row, i, most);
    box.append(span);
  });
  return box;
}

// an episode's column: reward, advantage and info on top, then each of its segments' tokens
function episode(by, dump, rows, most) {
  const col = el("div", "episode");
  const head = el("div", "head");
  const first = rows[0];
  head.append(el("b", "", `episode ${first.index}`));
  if ("error" in first) {
    head.append(el("div", "error", "failed: " + first.error));
    col.append(head);
    return col;
  }
  head.append(el("div", "reward", `reward ${fmt(first.reward)}`));
  if ("advantage" in first) head.append(el("div", "advantage", `advantage ${fmt(first.advantage)}`));
  const info = Object.entries(first.info || {}).map(([k, v]) => `${k} ${v}`).join(", ");
  head.append(el("div", "info", info));
  col.append(head);
  rows.forEach((row, s) => {
    if (rows.length > 1) col.append(el("div", "seg", `segment ${s + 1} of ${rows.length}`));
    col.append(tokens(by, dump, row, most));
  });
  return col;
}

function render() {
  const dump = DUMPS[dumpSelect.value];
  const by = bySelect.value;
  const most = extremes(dump);
  document.getElementById("scale").textContent = SCALES[by];
  // group -> episode index -> its rows (a chat episode has one row per segment); eval rows group by prompt
  const groups = new Map();
  for (const row of dump.rows) {
    const g = dump.kind === "eval" ? row.prompt : row.group;
    if (!groups.has(g)) groups.set(g, new Map());
    const episodes = groups.get(g);
    if (!episodes.has(row.index)) episodes.set(row.index, []);
    episodes.get(row.index).push(row);
  }
  const box = document.getElementById("groups");
  box.replaceChildren();
  for (const [g, episodes] of groups) {
    const rewards = [...episodes.values()].map(rows => ("error" in rows[0] ? "failed" : fmt(rows[0].reward)));
    const what = dump.kind === "eval" ? "prompt" : "group";
    box.append(el("h3", "group", `${what} ${g}: ${episodes.size} episodes, rewards ${rewards.join(" ")}`));
    const cols = el("div", "cols");
    for (const rows of episodes.values()) cols.append(episode(by, dump, rows, most));
    box.append(cols);
  }
}

document.querySelectorAll("input[name=x]").forEach(radio => {
  radio.onchange = () => { document.body.dataset.x = radio.value; };
});
DUMPS.forEach((dump, i) => dumpSelect.add(new Option(dump.label, i)));
// the dump the page's #fragment names (its label, e.g. #eval step 4), else the latest training dump, else the last
const wanted = decodeURIComponent(location.hash.slice(1));
let chosen = DUMPS.findIndex(dump => dump.label === wanted);
if (chosen < 0) chosen = DUMPS.map(dump => dump.kind).lastIndexOf("train");
if (chosen < 0) chosen = DUMPS.length - 1;
if (chosen >= 0) {
  dumpSelect.value = chosen;
  render();
} else {
  document.getElementById("groups").textContent = "no episodes dumped yet (dump_every)";
}
dumpSelect.onchange = render;
bySelect.onchange = render;
"""

PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title><style>{css}</style></head>
<body data-x="step">
<h1>{title}</h1>
<ul>{runs}</ul>
<div class="bar">x axis: <label><input type="radio" name="x" value="step" checked> step</label>
<label><input type="radio" name="x" value="wall"> wall time</label></div>
<div class="grid">{curves}</div>
<h2>Episodes</h2>
<div class="bar">dump <select id="dump"></select>
colour sampled tokens by <select id="by"><option value="logprob">engine logprob</option>
<option value="staleness">policy version (staleness)</option><option value="advantage">advantage</option></select>
<span id="scale"></span></div>
<div class="bar" id="roles">tokens: <span class="tok prompt">prompt</span>
<span class="tok env">environment / tool</span> <span class="tok sampled">sampled</span>
<span class="tok special">&lt;|special|&gt;</span> (hover a token: its id and numbers)
</div>
<div id="groups"></div>
<script>const DUMPS = {data};</script>
<script>{js}</script>
</body></html>
"""


def page(out_dirs):
    """The page's HTML for one run or several (compared)."""
    names = [os.path.normpath(d) for d in out_dirs]
    runs = {name: read_jsonl(os.path.join(d, "metrics.jsonl")) for name, d in zip(names, out_dirs)}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    several = len(out_dirs) > 1
    lines = [summary(name, rows, colours[r % len(colours)] if several else "#222")
             for r, (name, rows) in enumerate(runs.items())]
    data = [dump for name, d in zip(names, out_dirs) for dump in dumps(name, d, several)]
    # a JavaScript literal (NaN and Infinity are valid there, not in JSON); "<" only ever sits inside its strings,
    # where \u003c reads the same: no "</script>" in a token ends the script early
    text = json.dumps(data).replace("<", "\\u003c")
    title = "nanomolt: " + " vs ".join(names)
    return PAGE.format(title=html.escape(title), css=CSS, runs="\n".join(lines), curves=curves(runs), data=text,
                       js=JS)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", nargs="*", help="a run's out_dir (train.py --out_dir)")
    p.add_argument("--compare", nargs="+", default=[], metavar="OUT_DIR", help="more runs, their curves overlaid")
    p.add_argument("--out", help="where the page goes (default: the first run's dir/view.html)")
    args = p.parse_args()
    out_dirs = args.out_dir + args.compare
    if not out_dirs:
        p.error("name a run's out_dir")
    missing = [d for d in out_dirs if not os.path.isdir(d)]
    if missing:
        p.error(f"not a directory: {missing}")
    path = args.out or os.path.join(out_dirs[0], "view.html")
    with open(path, "w") as f:
        f.write(page(out_dirs))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
