"""The package's shape, read from its source with `ast` (no imports): the engine seam holds (outside sft/engines/
nothing imports deepspeed or names the DeepSpeed engine), the import graph of sft/ has no circles, no function is
over 60 lines (issue #80), every folder says in its `__init__` what lives there and what it may import, and steps per
epoch are counted only in the batch module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

SFT = ROOT / "sft"
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


MODULES = {module_name(p): p for p in sorted(SFT.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import anywhere in a module, functions included; `from a import b` gives `a.b` where
    that is a module of sft, else `a`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.append((node.lineno, full if full in MODULES else node.module))
    return found


def test_only_the_engines_import_deepspeed():
    """The engine seam: a second engine is a sibling of sft/engines/deepspeed/, not edits across the package."""
    outside = {name: tree for name, tree in TREES.items() if not name.startswith("sft.engines")}
    offending = [
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {module}"
        for name, tree in outside.items()
        for line, module in imported(tree)
        if module.split(".")[0] == "deepspeed" or module.startswith("sft.engines.deepspeed")
    ]
    assert not offending, offending
    assert {"sft.engines.base", "sft.engines.deepspeed"} <= set(MODULES)


def test_the_engines_import_only_what_their_folder_allows():
    """sft/engines/ wraps its libraries and may import of sft only the errors, which parameters are experts and the
    engines' declared traits and sharding (`sft.core.engine`)."""
    allowed = {"sft.errors", "sft.core.dims", "sft.core.engine"}
    offending = [
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {module}"
        for name, tree in TREES.items()
        if name.startswith("sft.engines")
        for line, module in imported(tree)
        if module.startswith("sft") and not module.startswith("sft.engines") and module not in allowed
    ]
    assert not offending, offending


# a test of a ZeRO stage number (issue #66): outside sft/engines/ the layout is asked what it shards (`Sharding`)
STAGE_TEST = re.compile(r"zero_stage ?(==|!=|in|is|<|>)|stage ?(==|!=|<|>|in \(|is (not )?None)")
STAGE_TESTS_ALLOWED = {"sft/core/engine.py": 2, "sft/plan/search.py": 1}  # Sharding's own; a trait's in_place_of


def test_nothing_outside_the_engines_tests_a_zero_stage_number():
    """The memory and speed models, the plan and the CLI read `Sharding.engine/.optimizer/.gradients/.weights`, not
    `zero_stage == 3`; the stage number is tested only inside `Sharding` (and compared once with the stage a trait
    declares it stands in for)."""
    found = {}
    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        if not rel.startswith("sft/engines/"):
            count = len(STAGE_TEST.findall(path.read_text()))
            if count:
                found[rel] = count
    assert found == STAGE_TESTS_ALLOWED, found


def test_the_configuration_imports_no_engine_model_plan_or_run_code():
    """`sft.config` parses and checks fields: of sft it imports the errors and the bottom layer only (the engine enters
    a run's arguments in the plan: `sft.plan.arguments`)."""
    modules = {m for _, m in imported(TREES["sft.config"]) if m.startswith("sft")}
    assert modules and all(m == "sft.errors" or m.startswith("sft.core") for m in modules), modules


def test_the_import_graph_has_no_circles():
    """Every import between sft's modules, at module level or inside a function, as a graph: no strongly connected
    component larger than one module (Tarjan's algorithm). A package importing its own submodules is not an edge
    back (Python imports the package first)."""
    graph = {
        name: {m for _, m in imported(tree) if m in MODULES and m != name and not name.startswith(f"{m}.")}
        for name, tree in TREES.items()
    }
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_no_function_is_over_60_lines():
    long = [
        f"{MODULES[name].relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


FOLDERS = sorted(p.name for p in SFT.iterdir() if p.is_dir() and p.name != "__pycache__")
# The folders from the bottom up: a folder imports those below it; an import of one above it is named in UPWARD
LAYERS = ("core", "engines", "model", "parallel", "data", "plan", "run", "tools")
# The imports that run back up, each with its folder's docstring saying why: none left (issue #66 found 8)
UPWARD: set[tuple[str, str]] = set()


def _sft_imports(folder: str) -> list[tuple[str, int, str]]:
    """(module, line, imported) of every import of another part of sft in a folder's modules, functions included."""
    return [(name, line, module) for name, tree in TREES.items() if name.startswith(f"sft.{folder}")
            for line, module in imported(tree)
            if module.startswith("sft.") and not module.startswith(f"sft.{folder}")]  # fmt: skip


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_folder_imports_only_what_its_docstring_allows(folder):
    """Each folder's `__init__` says what lives there and, after "May import", which parts of sft it may import
    (`sft.x` a folder or module, `sft.x.y` one module): every import of its modules, functions included, is one of
    them (or below: `sft.x` covers `sft.x.y`); "May import anything" for the tools."""
    doc = ast.get_docstring(TREES[f"sft.{folder}"]) or ""
    assert len(doc) > 100 and "May import" in doc, f"sft/{folder}/__init__.py: {doc!r}"
    rule = doc.split("May import", 1)[1]
    if rule.startswith(" anything"):
        return
    allowed = set(re.findall(r"`(sft(?:\.\w+)+)`", rule))
    covered = lambda module: any(module == a or module.startswith(f"{a}.") for a in allowed)  # noqa: E731
    offending = [f"{MODULES[name].relative_to(ROOT)}:{line} imports {module}"
                 for name, line, module in _sft_imports(folder) if not covered(module)]  # fmt: skip
    assert not offending, (allowed, offending)


def test_imports_run_back_up_the_layers_only_where_named():
    """The folders' layers (`LAYERS`, bottom up): no import of a folder above one's own (but those named in
    `UPWARD`)."""
    upward = set()
    for folder in LAYERS:
        for name, _, module in _sft_imports(folder):
            target = module.split(".")[1]
            if target in LAYERS and LAYERS.index(target) > LAYERS.index(folder):
                upward.add((name, ".".join(module.split(".")[:3])))
    assert upward == UPWARD, (upward - UPWARD, UPWARD - upward)


def test_steps_per_epoch_are_counted_only_in_the_batch_module():
    """An epoch's optimizer steps divide micro-batches by the accumulation: that division appears in
    sft/core/batch.py alone; everywhere else calls it (`steps_per_epoch`, `BatchPlan.steps_per_epoch`)."""
    divisions = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
                text = ast.unparse(node)
                if "accumulation" in text:
                    divisions.append((name, text))
    assert divisions and {name for name, _ in divisions} == {"sft.core.batch"}, divisions


def test_the_entry_point_and_the_tools_do_not_import_each_other_both_ways():
    """`sft.tools.check` builds its run through the entry point (`sft.train`), so the entry point imports no tool:
    the report it writes at the end lives below both (`sft.run.report`)."""
    assert any(module == "sft.train" for _, module in imported(TREES["sft.tools.check"]))
    offending = [module for _, module in imported(TREES["sft.train"]) if module.startswith("sft.tools")]
    assert not offending, offending


def test_no_folder_below_the_plan_reads_the_run_arguments_engine():
    """`run_engine` is an attribute of `sft.plan.arguments.RunArguments`, above `core`, `engines`, `model`, `parallel`
    and `data`: those folders are handed the engine (`sft.parallel.sequence.check(dims, engine, ...)`) instead of
    reading it off the training arguments, which the layout rules cannot see."""
    below = LAYERS[: LAYERS.index("plan")]
    reads = [f"{MODULES[name].relative_to(ROOT)}:{node.lineno}" for name, tree in TREES.items()
             if name.split(".")[1:2] and name.split(".")[1] in below
             for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "run_engine"]  # fmt: skip
    assert not reads, reads
