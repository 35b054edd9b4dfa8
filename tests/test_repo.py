import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_files():
    """Every .py file a researcher reads: all of them outside tests/ (bench.py and configs/ included)."""
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("out", "__pycache__")
                       and not (rel == Path(".") and d == "tests")]
        yield from (Path(dirpath) / name for name in filenames if name.endswith(".py"))


def non_blank(path):
    return [line for line in path.read_text().splitlines() if line.strip()]


def test_python_a_researcher_reads_is_under_3000_non_blank_lines_of_at_most_120_characters():
    counts = {str(p.relative_to(ROOT)): len(non_blank(p)) for p in python_files()}
    assert {"train.py", "config.py", "bench.py", "estimators.py"} <= counts.keys()  # the walk sees the repo
    assert sum(counts.values()) < 3000, "\n".join(f"{n:5d} {p}" for p, n in sorted(counts.items())) + \
        f"\n{sum(counts.values()):5d} total"
    long = [f"{p.relative_to(ROOT)}:{i}" for p in python_files() for i, line in enumerate(p.read_text().splitlines(), 1)
            if len(line) > 120]
    assert not long, long


def ruff(*args):
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *args],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_code_has_pep8_blank_lines_and_one_statement_a_line():
    """E301-E306: two blank lines around top-level definitions, one between methods (the budget does not count
    them); E701-E703: no `if x: y`, no `a; b`, so the count cannot be met by cramming."""
    ruff("--preview", "--select", "E301,E302,E303,E305,E306,E701,E702,E703", "--line-length", "120",
         *map(str, python_files()))


def test_code_and_tests_are_pyflakes_clean():
    ruff("--select", "F,E9", ".")


def test_readme_commands_are_what_ci_runs():
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    lines = blocks[0].strip("\n").split("\n")
    assert len(lines) == 2 and all(line.strip() for line in lines), lines
    assert all(line.startswith("pip install -r requirements.txt") for line in lines), lines
    ci = (ROOT / ".ci" / "run").read_text()
    extract = re.search(r"^cmd=\$\((.*)\)$", ci, re.M).group(1)  # run CI's own extraction
    out = subprocess.run(["bash", "-c", extract], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip("\n") == lines[1]
    assert 'bash -c "$cmd"' in ci
    assert "pytest" in lines[1]


def test_torch_is_pinned_exactly():
    reqs = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    assert "torch==2.13.0" in reqs
    assert not any(r.startswith("torch") and r != "torch==2.13.0" for r in reqs)
