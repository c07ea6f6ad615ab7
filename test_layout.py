"""The house's rules, checked: the README's code map names real code on the right side of the banner,
every metric key is in the glossary, the method has three `if ddp:` steps and ppo_update names nothing
of several processes, no module imports retireopd.py back, and cProfile and pdb run the script."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli


@pytest.mark.slow
def test_every_metric_key_is_in_the_readme_glossary(tmp_path):
    _, metrics, _ = run_cli(tmp_path, "glossary", "--env", "webshop", "--iterations", "3")
    keys = {key for m in metrics for key in m}
    glossary = (Path(__file__).parent / "docs" / "metrics.md").read_text()
    missing = sorted(k for k in keys if f"`{k}`" not in glossary)
    assert not missing, f"metrics.jsonl keys missing from docs/metrics.md: {missing}"


def test_readme_code_map_names_real_code_and_the_method_sits_above_the_banner():
    # The README's paper -> code map names each function with its section; sections 1-6 are the
    # method, which must be defined above the plumbing banner (a reader who stops there has it all).
    import ast
    import re
    source = (Path(__file__).parent / "retireopd.py").read_text()
    banner = next(n for n, line in enumerate(source.splitlines(), 1) if line.startswith("# The method ends here"))
    defined = {getattr(node, "name", None) or ast.unparse(node.targets[0]): node.lineno
               for node in ast.parse(source).body if hasattr(node, "name") or isinstance(node, ast.Assign)}
    table = (Path(__file__).parent / "README.md").read_text().split("## Paper → code map")[1].split("\n## ")[0]
    rows = re.findall(r"\| ((?:`\w+`(?:, )?)+) \((\d+)", table)
    assert len(rows) >= 20
    for names, section in rows:
        for name in re.findall(r"`(\w+)`", names):
            assert name in defined, f"the README's code map names {name}, which retireopd.py does not define"
            assert (defined[name] < banner) == (int(section) <= 6), f"{name} (section {section}) is on the wrong side"


def method_source():
    """retireopd.py's syntax tree, and the line of its banner (sections 1-6 are above it)."""
    import ast
    source = (Path(__file__).parent / "retireopd.py").read_text()
    banner = next(n for n, line in enumerate(source.splitlines(), 1) if line.startswith("# The method ends here"))
    return ast.parse(source), banner


def test_the_banner_names_every_helper_below_it_that_the_method_calls():
    # The banner's promise: a reader who stops there has read the method, and knows by name what it calls
    # from below it and from run_outputs.py (what the run writes). Its list and the code agree: every name
    # defined below the banner or imported from run_outputs.py that the method uses (an annotation too), and
    # every method it calls on a run, models or frozen object, is in the banner's comment, and nothing else.
    import ast
    import re
    import run_outputs
    tree, banner = method_source()
    lines = (Path(__file__).parent / "retireopd.py").read_text().splitlines()
    start = max(n for n in range(banner) if lines[n - 1].startswith("#####"))
    end = next(n for n in range(banner, len(lines)) if lines[n - 1].startswith("#####"))
    named = set(re.findall(r"`([\w.]+)`", "\n".join(lines[start:end - 1])))
    below = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
             and node.lineno > banner}
    outputs = {alias.name for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "run_outputs"
               for alias in node.names}
    called = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and node.lineno < banner
              and (node.id in below or node.id in outputs)}
    owners = {"run": run_outputs.Run, "models": "ModelLoader", "frozen": "FrozenModels"}
    called |= {f"{getattr(owners[node.func.value.id], '__name__', owners[node.func.value.id])}.{node.func.attr}"
               for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and isinstance(node.func.value, ast.Name) and node.func.value.id in owners and node.lineno < banner}
    assert called <= named, f"the method calls, from below the banner, {sorted(called - named)}: name them there"
    assert named <= called, f"the banner names {sorted(named - called)}, which the method does not call"
    for name in (name for name in called if "." in name):
        owner, method = name.split(".")
        assert hasattr(run_outputs.Run, method) if owner == "Run" else any(
            isinstance(item, ast.FunctionDef) and item.name == method for item in below[owner].body), name


def test_the_method_has_three_ddp_steps_and_ppo_update_reads_as_one_process():
    # A one-process reader of sections 1-6 skips every torchrun step by skipping its `if ddp:` steps (an
    # `if ddp:` block, a `... if ddp else ...` or a `ddp and ...`): there are three, and no call into
    # multigpu.py hides in a neutral line. ppo_update, the update itself, names nothing of several processes.
    import ast
    tree, banner = method_source()
    guarded, uses = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)) and isinstance(node.test, ast.Name) and node.test.id == "ddp":
            for part in (node.body if isinstance(node, ast.If) else [node.body]):
                guarded |= {id(inner) for inner in ast.walk(part)}
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And) and getattr(node.values[0], "id", "") == "ddp":
            guarded |= {id(inner) for part in node.values[1:] for inner in ast.walk(part)}  # `ddp and ...`
        if isinstance(node, ast.Name) and node.id == "ddp" and isinstance(node.ctx, ast.Load) and node.lineno < banner:
            uses.append(node.lineno)
    assert len(uses) == 3, f"the method's `if ddp:` steps are at lines {uses}: three, where processes differ"
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
             and node.value.id == "multigpu" and node.lineno < banner]
    assert len(calls) == 3  # the share of tasks, the sampling copy, K over every rank's tokens
    loose = [node.lineno for node in calls if id(node) not in guarded]
    assert loose == [], f"multigpu calls outside an `if ddp:` step above the banner, lines {loose}"
    update = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "ppo_update")
    names = {node.id for node in ast.walk(update) if isinstance(node, ast.Name)} | {
        node.attr for node in ast.walk(update) if isinstance(node, ast.Attribute)}
    several = {"ddp", "multigpu", "rank", "world_size", "in_lockstep", "idle_pass", "all_ranks", "full_tensor",
               "global_batch", "offset", "gather_objects", "broadcast"}
    assert names & several == set(), f"ppo_update names {sorted(names & several)}"


def test_no_module_imports_the_method_back_and_ordinary_tooling_runs_the_script(tmp_path):
    # modules are leaves: only scripts (study.py, bench.py) and tests import retireopd.py, which touches no
    # sys.modules entry, so `python -m cProfile retireopd.py` and `python -m pdb retireopd.py` run it whole
    import ast
    here = Path(__file__).parent
    for path in sorted(here.glob("*.py")):
        if path.name.startswith(("test_", "conftest")) or path.name in ("study.py", "bench.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            imported = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            assert "retireopd" not in imported, f"{path.name} imports retireopd (line {node.lineno})"
    assert "sys.modules" not in (here / "retireopd.py").read_text()
    tools = [["-m", "cProfile", "-o", str(tmp_path / "prof.out")], ["-m", "pdb", "-c", "continue"]]
    if sys.version_info[:3] == (3, 13, 0):  # its pdb refuses a script's own flags (CPython gh-125115, fixed in 3.13.1)
        tools.pop()
    for tool in tools:
        done = subprocess.run([sys.executable, *tool, "retireopd.py", "--show-prompts"], cwd=here,
                              capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert done.returncode == 0 and "===== teacher" in done.stdout, (tool, done.stderr[-2000:])


def test_the_script_its_docstring_and_the_modules_beside_it_stay_short():
    # the module docstring is read first (at most 20 lines); the script stays within 1800 lines; the checks of
    # flags, models and run folders are four modules, one concern each, and what a run writes a fifth, each
    # under 450 lines (a leaf: the test above)
    import ast
    here = Path(__file__).parent
    source = (here / "retireopd.py").read_text()
    docstring = ast.parse(source).body[0]
    assert docstring.end_lineno - docstring.lineno + 1 <= 20
    assert len(source.splitlines()) <= 1800  # what one process needs beyond the method lives in modules
    for name in ("settings.py", "model_sources.py", "run_folder.py", "repairs.py", "run_outputs.py"):
        assert len((here / name).read_text().splitlines()) <= 450, name
