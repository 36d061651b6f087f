"""The package's imports follow the data flow, and no module imports itself round a circle.

    base (errors.py, cluster.py: top-level modules) -> models (built-in example models) -> ir
    -> sharding_spec -> record -> cost_model -> solver -> codegen -> runtime -> compose -> autopar (the
    package's public names) -> cli -> __main__

Every import counts, at module level or inside a function (or under ``TYPE_CHECKING``), and so does
``importlib.import_module("autopar...")`` with a literal name. A module may import its own layer
and those before it. ``from package import name`` reads ``package``'s ``__init__`` (and the
submodule ``name``, when it is one): a submodule reaching a sibling that way imports its package's
``__init__``, which imports it back, a circle. A package's ``__init__`` importing its own
submodules is an import like any other (Python runs a package's ``__init__`` before any of its
submodules, but that is not an import the module makes).
"""
from __future__ import annotations

import ast
import dataclasses
import shutil
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "autopar"

# The flow, first to last; a module's layer is its subpackage's, or one of the entries below.
FLOW = ("ir", "sharding_spec", "record", "cost_model", "solver", "codegen", "runtime", "compose")
LAYERS = ("base", "models", *FLOW, "api", "cli", "main")


@dataclasses.dataclass(frozen=True)
class Import:
    src: str  # the importing module
    dst: str  # the imported module (a package stands for its __init__)
    where: str  # file:line
    text: str  # the import statement as written


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``root``."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def imports(root: Path) -> list[Import]:
    """Every import of a module of the package at ``root`` by one of its modules."""
    modules = module_names(root)
    package = root.name
    out = []
    for src, path in modules.items():
        text = path.read_text()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(text, str(path))):
            targets = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    name = alias.name
                    while name and name not in modules:  # ``import a.b`` where b is no module: a
                        name = name.rpartition(".")[0]
                    targets.append(name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package
                    anchor = src.split(".") if is_package else src.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets.append(base)
                targets += [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                  in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)):
                targets.append(node.args[0].value)
            for dst in targets:
                if dst in modules and dst != src and dst.split(".")[0] == package:
                    where = f"{path.relative_to(root.parent)}:{node.lineno}"
                    statement = ast.get_source_segment(text, node) or ast.unparse(node)
                    out.append(Import(src, dst, where, " ".join(statement.split())))
    return out


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"  # the package's __init__: its public names
    if parts[1] == "__main__":
        return "main"
    if parts[1] in FLOW or parts[1] in ("models", "cli"):
        return parts[1]
    if len(parts) == 2:
        return "base"  # a top-level module (errors, cluster)
    raise AssertionError(f"{module} is in no layer of the flow; give its subpackage a place in LAYERS")


def layer_violations(found: list[Import]) -> list[str]:
    """Imports of a later layer into an earlier one, each as ``file:line: statement (why)``."""
    out = []
    for imp in found:
        a, b = layer_of(imp.src), layer_of(imp.dst)
        if LAYERS.index(b) > LAYERS.index(a):
            out.append(f"{imp.where}: {imp.text!r} imports {imp.dst} ({b}) into {imp.src} ({a}), against the flow")
    return out


def cycles(found: list[Import]) -> list[str]:
    """One circle of imports per strongly connected group of modules, each import as ``file:line``."""
    graph: dict[str, dict[str, Import]] = {}
    for imp in found:
        graph.setdefault(imp.src, {}).setdefault(imp.dst, imp)
        graph.setdefault(imp.dst, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def connect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    out = []
    for group in groups:
        start = min(group)
        # the shortest circle through ``start`` inside the group (breadth first)
        prev: dict[str, Import] = {}
        frontier = [start]
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w, imp in sorted(graph[v].items()):
                    if w in group and w not in prev:
                        prev[w] = imp
                        nxt.append(w)
            frontier = nxt
        chain, v = [], start
        while True:
            imp = prev[v]
            chain.append(f"{imp.where}: {imp.text!r} ({imp.src} -> {imp.dst})")
            v = imp.src
            if v == start:
                break
        out.append(f"a circle of {len(group)} modules ({', '.join(sorted(group))}):\n    "
                   + "\n    ".join(reversed(chain)))
    return out


# ---- the package ----------------------------------------------------------------------------------
def test_imports_follow_the_flow():
    found = imports(ROOT)
    # the checker sees what it must: function-level imports and every layer
    assert len(found) > 300 and {layer_of(i.src) for i in found} == set(LAYERS)
    assert any(i.src == "autopar.compose.parallelize" and i.dst == "autopar.runtime.module" for i in found)
    bad = layer_violations(found)
    assert not bad, "imports against the flow:\n" + "\n".join(bad)


def test_codegen_and_the_runtime_do_not_plan():
    """They run the plan they are given (its fields: specs, steps, stages), so they import nothing of
    the solver: no search, no ILP, not even the Plan records."""
    bad = [f"{i.where}: {i.text!r}" for i in imports(ROOT)
           if layer_of(i.src) in ("codegen", "runtime") and layer_of(i.dst) == "solver"]
    assert not bad, "codegen or the runtime imports the solver:\n" + "\n".join(bad)


def test_codegen_and_the_runtime_do_not_price():
    """They read what a step runs from the record (buckets, gather groups, gradient conventions,
    schedules), which lives below the cost model; a price never decides what runs."""
    bad = [f"{i.where}: {i.text!r}" for i in imports(ROOT)
           if layer_of(i.src) in ("codegen", "runtime") and layer_of(i.dst) == "cost_model"]
    assert not bad, "codegen or the runtime imports the cost model:\n" + "\n".join(bad)


def test_no_module_imports_itself_round_a_circle():
    bad = cycles(imports(ROOT))
    assert not bad, "import circles:\n" + "\n".join(bad)


# ---- the checker, on planted violations -----------------------------------------------------------------
def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "autopar"
    for rel, body in {"__init__.py": "", "errors.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:  # every folder a package
            (root / parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(body))
    return root


def test_an_import_against_the_flow_is_named(tmp_path):
    root = _package(tmp_path, {
        "ir/graph.py": "import math\n\n\ndef f():\n    from autopar.solver.api import plan\n    return plan\n",
        "solver/api.py": "from autopar.ir.graph import f\nfrom autopar.errors import X\n",
    })
    bad = layer_violations(imports(root))
    assert bad == ["autopar/ir/graph.py:5: 'from autopar.solver.api import plan' imports autopar.solver.api (solver) "
                   "into autopar.ir.graph (ir), against the flow"]


def test_the_real_package_with_one_planted_import_fails(tmp_path):
    copy = tmp_path / "autopar"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    mesh = copy / "sharding_spec" / "mesh.py"
    lines = len(mesh.read_text().splitlines())
    mesh.write_text(mesh.read_text() + "\n\ndef _price():\n    import autopar.cost_model.comm\n")
    bad = layer_violations(imports(copy))
    assert len(bad) == 1 and bad[0].startswith(f"autopar/sharding_spec/mesh.py:{lines + 4}: 'import autopar.cost_model.comm'")
    assert cycles(imports(copy)) == []  # comm does not import the mesh module back


def test_a_circle_is_named_with_each_import(tmp_path):
    root = _package(tmp_path, {
        "solver/a.py": "from autopar.solver.b import g\n",
        "solver/b.py": "def g():\n    import autopar.solver.a\n",
    })
    assert cycles(imports(root)) == [
        "a circle of 2 modules (autopar.solver.a, autopar.solver.b):\n"
        "    autopar/solver/a.py:1: 'from autopar.solver.b import g' (autopar.solver.a -> autopar.solver.b)\n"
        "    autopar/solver/b.py:2: 'import autopar.solver.a' (autopar.solver.b -> autopar.solver.a)"]


def test_a_sibling_reached_through_the_package_is_a_circle_a_reexport_is_not(tmp_path):
    files = {"solver/__init__.py": "from autopar.solver.api import plan\n",
             "solver/ilp.py": "def solve():\n    pass\n",
             "solver/api.py": "from autopar.solver.ilp import solve\n"}
    assert cycles(imports(_package(tmp_path / "fine", files))) == []
    files["solver/api.py"] = "def plan():\n    from autopar.solver import ilp\n"
    bad = cycles(imports(_package(tmp_path / "circle", files)))
    assert len(bad) == 1 and "autopar/solver/api.py:2: 'from autopar.solver import ilp' (autopar.solver.api -> autopar.solver)" in bad[0]
    assert "autopar/solver/__init__.py:1" in bad[0]


@pytest.mark.parametrize("statement", ["import importlib\nimportlib.import_module('autopar.solver.api')\n",
                                       "from . import api\n", "from .api import plan\n"])
def test_imports_by_name_and_relative_imports_count(tmp_path, statement):
    root = _package(tmp_path, {"solver/api.py": "def plan():\n    pass\n", "solver/__init__.py": "",
                               "solver/ilp.py": statement})
    assert any(i.src == "autopar.solver.ilp" and i.dst == "autopar.solver.api" for i in imports(root))
