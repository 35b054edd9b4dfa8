import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the framework: the flat top-level scripts, counted by the budget
FRAMEWORK = sorted(p for p in ROOT.glob("*.py"))
# beside it, not counted, each file small: (folder, the most non-blank lines a file may have)
BESIDE = {"configs": 40, "agents": 150, "tools": 400}


def beside_files():
    return [p for folder in BESIDE for p in sorted((ROOT / folder).rglob("*.py"))]  # agents/vf_envs/ too


def non_blank(path):
    return [line for line in path.read_text().splitlines() if line.strip()]


def test_the_framework_is_under_3000_non_blank_lines_of_at_most_120_characters():
    counts = {p.name: len(non_blank(p)) for p in FRAMEWORK}
    assert {"train.py", "rollout.py", "engine.py", "servers.py", "agent.py", "config.py"} <= counts.keys()
    assert sum(counts.values()) < 3000, "\n".join(f"{n:5d} {p}" for p, n in sorted(counts.items())) + \
        f"\n{sum(counts.values()):5d} total"
    long = [f"{p.relative_to(ROOT)}:{i}" for p in FRAMEWORK + beside_files()
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 120]
    assert not long, long


def test_configs_agents_and_tools_are_small_and_the_framework_imports_none_of_them():
    assert {"guess.py", "calc.py", "arith.py", "count.py"} <= {p.name for p in (ROOT / "agents").glob("*.py")}
    assert (ROOT / "tools" / "bench.py").is_file()
    big = [f"{p.relative_to(ROOT)}: {len(non_blank(p))}" for p in beside_files()
           if len(non_blank(p)) > BESIDE[p.relative_to(ROOT).parts[0]]]
    assert not big, f"over their folder's limit {BESIDE}: {big}"
    for p in FRAMEWORK:
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if n.split(".")[0] in BESIDE]
            assert not bad, f"{p.name}:{node.lineno} imports {bad}: the framework imports nothing from {list(BESIDE)}"


# The one direction imports run: each framework module imports only those below it
LAYERS = {"train": 0, "rollout": 1, "servers": 2, "engine": 3, "endpoint": 3, "agent": 4, "config": 4,
          "model_moe": 5, "estimators": 5}


def test_framework_imports_run_one_way_down():
    for p in FRAMEWORK:
        if p.stem not in LAYERS:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for n in (n.split(".")[0] for n in names):
                if n in LAYERS:
                    assert LAYERS[n] > LAYERS[p.stem], f"{p.name}:{node.lineno} imports {n}, which is not below it"


def idioms(tree):
    """-> (line, what) for each idiom a reader must unpack (STYLE.md, point 11)."""
    found = []
    in_condition = set()  # walrus allowed in an if / while condition (its own test, not the body)
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While)):
            in_condition |= {id(n) for n in ast.walk(node.test)}
    for node in ast.walk(tree):
        if isinstance(node, ast.NamedExpr) and id(node) not in in_condition:
            found.append((node.lineno, "walrus outside an if/while condition"))
        if isinstance(node, ast.Expr) and isinstance(node.value, (ast.IfExp, ast.BoolOp)):
            found.append((node.lineno, "a conditional expression, `and` or `or` used as a statement"))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.BoolOp) and isinstance(node.value.op, ast.And) \
                and any(isinstance(n, ast.Call) for v in node.value.values[1:] for n in ast.walk(v)):
            found.append((node.lineno, "`and` choosing whether a call runs"))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and isinstance(node.left, ast.UnaryOp) \
                and isinstance(node.left.op, ast.USub):
            found.append((node.lineno, "the ceiling trick -(-a // b): use math.ceil"))
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            for side in (node.left, node.right):
                if isinstance(side, ast.Compare) or (isinstance(side, ast.UnaryOp) and isinstance(side.op, ast.Not)):
                    found.append((node.lineno, "arithmetic on a boolean"))
        if isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Add, ast.Sub)) and (
                isinstance(node.value, ast.Compare)
                or (isinstance(node.value, ast.UnaryOp) and isinstance(node.value.op, ast.Not))):
            found.append((node.lineno, "arithmetic on a boolean"))
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple) \
                and isinstance(node.value, ast.Tuple) and len(node.value.elts) >= 3:
            found.append((node.lineno, "parallel assignment of three or more values"))
    return found


def test_framework_code_has_none_of_the_idioms_a_reader_must_unpack():
    found = [f"{p.name}:{line}: {what}" for p in FRAMEWORK for line, what in idioms(ast.parse(p.read_text()))]
    assert not found, "\n".join(sorted(found))


def test_the_idiom_check_finds_each_idiom():
    code = """
x = [y for z in w if (y := z)]
a and b()
f() if c else g()
n = -(-a // b)
k = (i + 1) * (j > 0)
k += not ok
p, q, r = 1, 2, 3
net = gae and build(x)
if (m := 3) > 2:
    pass
while (chunk := read()) and net:
    pass
p, q = 1, 2
default = given or {}
"""
    assert sorted(line for line, _ in idioms(ast.parse(code))) == [2, 3, 4, 5, 6, 7, 8, 9]


def ruff(*args):
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *args],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_code_has_pep8_blank_lines_and_one_statement_a_line():
    """E301-E306: two blank lines around top-level definitions, one between methods (the budget does not count
    them); E701-E703: no `if x: y`, no `a; b`, so the count cannot be met by cramming."""
    ruff("--preview", "--select", "E301,E302,E303,E305,E306,E701,E702,E703", "--line-length", "120",
         *map(str, FRAMEWORK + beside_files()))


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


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: results go to RESULTS.md, details to docs/"


def test_torch_is_pinned_exactly():
    reqs = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    assert "torch==2.13.0" in reqs
    assert not any(r.startswith("torch") and r != "torch==2.13.0" for r in reqs)
