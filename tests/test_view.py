"""tools/view.py in a real browser: headless Chromium opens the page of a short default run and of a short chat-agent
run from disk, runs its script, and the assertions read the rendered DOM (curves drawn, sampled tokens coloured, each
episode's reward shown) and the screenshot. The screenshots' paths are printed (pytest -s): look at them when you
change the page. Chromium comes from tests/install_chromium.sh (Debian's package); a failed install fails the tests."""
import json
import os
import subprocess
import sys
from html.parser import HTMLParser

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = "/usr/bin/chromium"
SMALL = ["--max_steps=4", "--eval_every=2", "--eval_prompts=2", "--eval_samples=2", "--dump_every=2",
         "--prompts_per_step=2", "--ckpt_every=0"]
RUNS = {"guess": [], "calc": ["--task=calc", "--engine_max_len=512"]}  # the default run, and a chat agent's

pytestmark = pytest.mark.slow  # two training runs, six browser runs, the install: about a minute on two cores


@pytest.fixture(scope="session")
def chromium():
    """Debian's chromium, installed once (idempotent); an install that fails fails every test here, never skips."""
    p = subprocess.run(["bash", os.path.join(ROOT, "tests", "install_chromium.sh")], capture_output=True, text=True)
    if p.returncode != 0 or not os.path.exists(CHROMIUM):
        pytest.fail(f"tests/install_chromium.sh failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return CHROMIUM


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """{name: out_dir} of the two short runs, each with training and eval dumps at steps 2 and 4."""
    dirs = {}
    for name, extra in RUNS.items():
        out = tmp_path_factory.mktemp(name)
        cmd = [sys.executable, "train.py", "--config", "configs/guess.py", f"--out_dir={out}", *SMALL, *extra]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
        dirs[name] = out
    return dirs


def view(*args):
    p = subprocess.run([sys.executable, "tools/view.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]


def browse(chromium, page, shot, fragment=""):
    """Open the page from disk, let its script run, -> (the rendered DOM as HTML, the screenshot's path)."""
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run",
           f"--user-data-dir={shot.parent / 'profile'}", "--virtual-time-budget=10000", f"--screenshot={shot}",
           "--window-size=1400,2200", "--dump-dom", page.as_uri() + fragment]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "</html>" in p.stdout, p.stderr[-3000:]
    print(f"screenshot: {shot}")
    return p.stdout, shot


class Dom(HTMLParser):
    """The rendered DOM as a list of elements: {"tag", "attrs", "parents": [the elements around it], "text"}."""
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self, page):
        super().__init__(convert_charrefs=True)
        self.elements = []
        self.open = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        node = {"tag": tag, "attrs": dict(attrs), "parents": list(self.open), "text": ""}
        self.elements.append(node)
        if tag not in self.VOID:
            self.open.append(node)

    def handle_startendtag(self, tag, attrs):
        self.elements.append({"tag": tag, "attrs": dict(attrs), "parents": list(self.open), "text": ""})

    def handle_endtag(self, tag):
        while self.open and self.open.pop()["tag"] != tag:
            continue

    def handle_data(self, data):
        for node in self.open:
            node["text"] += data

    def find(self, tag, cls=None):
        """The elements of a tag (with a class among their classes)."""
        return [e for e in self.elements if e["tag"] == tag
                and (cls is None or cls in e["attrs"].get("class", "").split())]


def curve_paths(dom, key, x="step"):
    """The drawn SVG path elements of a key's curve in its plot against x."""
    return [e for e in dom.find("path") if "d" in e["attrs"]
            and any(p["attrs"].get("id") == f"curve {key}" for p in e["parents"])
            and any(p["attrs"].get("data-x") == x and key in p["attrs"].get("data-keys", "").split()
                    for p in e["parents"])]


def token_spans(dom, cls="tok"):
    """The spans of the episodes' tokens (of a class: prompt, env, sampled)."""
    return [e for e in dom.find("span", cls) if any("tokens" in p["attrs"].get("class", "").split()
                                                     for p in e["parents"])]


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def check_dump(dom, rows):
    """The rendered episodes are rows' (one dump): a column per episode with its reward, a span per token, each
    sampled token's span with a background colour the script set."""
    heads = dom.find("div", "head")
    episodes = {r["index"]: r for r in rows if "reward" in r}  # (a failed episode has an error instead)
    assert len(heads) == len({r["index"] for r in rows})
    shown = [e["text"] for e in dom.find("div", "reward")]
    assert sorted(shown) == sorted(f"reward {r['reward']:.3f}" for r in episodes.values())
    groups = " ".join(e["text"] for e in dom.find("h3", "group"))
    assert all(f"{r['reward']:.3f}" in groups for r in episodes.values())
    rows = [r for r in rows if "reward" in r]
    assert all("pieces" in r and "versions" in r for r in rows), "a dump without the per-token fields"
    assert len(token_spans(dom)) == sum(len(r["ids"]) for r in rows)
    sampled = token_spans(dom, "sampled")
    assert len(sampled) == sum(sum(r["mask"]) for r in rows) > 0
    assert all("background" in e["attrs"].get("style", "") for e in sampled)
    assert all(e["attrs"]["title"].startswith("sampled token") and " id " in e["attrs"]["title"] for e in sampled)


def check_png(shot):
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, len(data)


@pytest.mark.parametrize("name", list(RUNS))
def test_the_page_of_a_run_renders_its_curves_and_episodes(chromium, runs, name, tmp_path):
    out = runs[name]
    view(out)
    page, shot = browse(chromium, out / "view.html", tmp_path / "latest.png")
    check_png(shot)
    dom = Dom(page)
    for x in ("step", "wall"):
        paths = curve_paths(dom, "reward/mean", x)
        segments = [p["attrs"]["d"].split().count("L") for p in paths]  # a line through the 4 steps: M, then 3 L
        assert max(segments, default=0) >= 3, f"no reward/mean curve against {x}"
    for key in ("eval/pass@1", "eval/pass@2", "staleness/mean", "time/step", "throughput/train_tokens_per_s"):
        assert curve_paths(dom, key), key
    # the page opens at the latest training dump, step 4, each episode with its advantage
    rows = [r for r in read_jsonl(out / "episodes.jsonl") if r["step"] == 4]
    check_dump(dom, rows)
    shown = sorted(e["text"] for e in dom.find("div", "advantage"))
    assert shown == sorted(f"advantage {r['advantage']:.3f}" for r in {r["index"]: r for r in rows}.values())
    options = [e["text"] for e in dom.find("option")]
    assert {"train step 2", "eval step 2", "train step 4", "eval step 4"} <= set(options)
    # an evaluation's dump, chosen by the page's #fragment: its episodes grouped by prompt, no advantage
    page, shot = browse(chromium, out / "view.html", tmp_path / "eval.png", "#eval%20step%204")
    dom = Dom(page)
    check_dump(dom, read_jsonl(out / "eval" / "step_4.jsonl"))
    assert [e["text"].split(":")[0] for e in dom.find("h3", "group")] == ["prompt 0", "prompt 1"]
    check_png(shot)


def test_compare_overlays_two_runs_each_a_colour_named_in_the_legend(chromium, runs, tmp_path):
    page = tmp_path / "compare.html"
    view("--compare", runs["guess"], runs["calc"], "--out", page)
    html, shot = browse(chromium, page, tmp_path / "compare.png")
    dom = Dom(html)
    paths = curve_paths(dom, "reward/mean")
    styles = [s.strip() for p in paths for s in p["attrs"].get("style", "").split(";")]
    strokes = {s for s in styles if s.startswith("stroke:")}
    assert len(strokes) == 2, strokes  # a colour each
    legend = " ".join(e["text"] for e in dom.find("text"))
    assert str(runs["guess"]) in legend and str(runs["calc"]) in legend
    assert {f"{runs[n]}: train step 4" for n in RUNS} <= {e["text"] for e in dom.find("option")}
    check_png(shot)


def test_a_run_in_progress_and_an_older_dump(chromium, runs, tmp_path):
    """What a run has written so far: two steps, an evaluation's own line (step and eval/ keys only), a half-written
    line; a dump from before the per-token fields shows its text."""
    lines = open(runs["guess"] / "metrics.jsonl").readlines()[:2]
    lines += [json.dumps({"step": 2, "eval/pass@1": 0.25, "eval/pass@2": 0.5}) + "\n", lines[0][:40]]
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    old = [{k: v for k, v in r.items() if k not in ("ids", "pieces", "mask", "logprobs", "versions")}
           for r in read_jsonl(runs["guess"] / "episodes.jsonl") if r["step"] == 2]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    view(tmp_path)
    html, shot = browse(chromium, tmp_path / "view.html", tmp_path / "progress.png")
    dom = Dom(html)
    check_png(shot)
    assert curve_paths(dom, "reward/mean") and curve_paths(dom, "eval/pass@2", "wall")
    texts = [e["text"] for e in dom.find("div", "tokens")]
    assert sorted(texts) == sorted(r["text"] for r in old) and not token_spans(dom)
    assert sorted(e["text"] for e in dom.find("div", "reward")) == sorted(f"reward {r['reward']:.3f}" for r in old)
