"""simdist's modules form a one-way chain of layers, with no import cycle and no import inside a function.

The chain: the simulator-free base (``simdist_base``: the error root, the script convention, host memory) ->
foundation (errors, units, trace records, device models, algorithm schedules) -> clock and rank
threads -> network -> communication -> torch.distributed's face -> the run (``simdist.run``) -> the equivalence oracle -> HTML reports -> tools (CLI, bench, scripts, the package's
public API). A module may import its own layer and the layers before it, never a later one. Imports inside
functions count as edges too, so a cycle cannot hide behind a lazy import; and apart from optional heavy
dependencies there are none.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import networkx as nx
import pytest

import simdist.layers

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("simdist", "simdist_base", "real")

#: layers in order (simdist.layers.LAYERS); a module belongs to the last layer one of whose prefixes it starts with
LAYERS: list[tuple[str, tuple[str, ...]]] = [(layer.name, layer.modules) for layer in simdist.layers.LAYERS]
#: packages outside the chain and the simdist modules each may import (strategies: plain torch.distributed)
OUTSIDE = dict(simdist.layers.OUTSIDE)
#: function-level imports allowed: (module, imported module) for optional heavy dependencies only
LAZY_ALLOWED: set[tuple[str, str]] = {
    # the launcher imports the simulator only when a launch asks for --emulate-cuda: it must run with torch alone
    ("real.emulated_cuda", "simdist.compute.devices"),
    ("real.emulated_cuda", "simdist.cuda.native"),
    ("real.emulated_cuda", "simdist.cudart.process"),
    ("real.emulated_cuda", "simdist.cudart.api"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {
        module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) if "__pycache__" not in p.parts
    }


@functools.cache
def parsed(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once for every scan of this module (read only)."""
    return ast.parse(path.read_text(), str(path))


def imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function, line) for every import of a project module in ``path``."""
    tree = parsed(path)
    is_pkg = path.name == "__init__.py"
    # one walk down the tree, noting for each import whether it is inside a function (lazy) or inside an
    # `if TYPE_CHECKING:` block (for annotations only: it never runs, and is left out)
    flags: dict[int, tuple[bool, bool]] = {}
    stack = [(tree, False, False)]
    while stack:
        node, lazy, typing_only = stack.pop()
        for child in ast.iter_child_nodes(node):
            child_lazy = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            child_typing = typing_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                flags[id(child)] = (child_lazy, child_typing)
            stack.append((child, child_lazy, child_typing))
    out = []
    for node in ast.walk(tree):  # in the order of the walk, as the edges are listed
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        lazy, typing_only = flags[id(node)]
        if typing_only:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.append((t, lazy, node.lineno))
    return out


def layer_of(name: str) -> int | None:
    """The layer of ``name``: the one with the longest prefix it starts with."""
    matches = [
        (len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes if name == p or name.startswith(p + ".")
    ]
    return max(matches)[1] if matches else None


def outside_package(name: str) -> str | None:
    return next((p for p in OUTSIDE if name == p or name.startswith(p + ".")), None)


MODULES = all_modules()


@functools.cache
def import_edges() -> dict[str, list[tuple[str, bool, int]]]:
    """Every module's imports of project modules (parsed when a test first asks: not at collection, where each
    pytest worker would parse every module)."""
    return {name: imports(name, path, MODULES) for name, path in MODULES.items()}


def test_the_scan_sees_the_packages() -> None:
    assert {"simdist", "simdist.engine.runner", "simdist.c10d.backend", "simdist.clock.baton", "real.launcher"} <= set(
        MODULES
    )
    assert ("simdist.clock.baton", False) in {(t, lazy) for t, lazy, _ in import_edges()["simdist.engine.runner"]}


#: what ``import real`` and ``python -m real`` load: the launcher, which must run where only torch is installed
LAUNCHER_ENTRIES = ("real", "real.__main__")
#: the one launcher module that imports the simulator, inside functions, when a launch asks for --emulate-cuda
EMULATION_ON_REQUEST = "real.emulated_cuda"


def test_the_launcher_imports_nothing_of_the_simulator() -> None:
    # Any simdist module runs simdist/__init__.py, which imports simpy and patches torch privates for one
    # torch range: the launcher reaches only simdist_base. (tests/test_real_import.py runs it without simpy.)
    seen, todo = set(), list(LAUNCHER_ENTRIES)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [
                target
                for target, lazy, _ in import_edges()[name]
                if not (name == EMULATION_ON_REQUEST and lazy and target.startswith("simdist."))
            ]
    assert "real.launcher" in seen and "simdist_base.script" in seen and EMULATION_ON_REQUEST in seen
    assert not sorted(m for m in seen if m == "simdist" or m.startswith("simdist.")), "the launcher imports the simulator"


def test_no_import_cycle_between_modules_counting_function_level_imports() -> None:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for name, edges in import_edges().items():
        for target, _, _ in edges:
            # a package's __init__ re-exporting its own submodules is not a dependency of the package's parts
            if not target.startswith(name + "."):
                graph.add_edge(name, target)
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_no_import_inside_a_function() -> None:
    lazy = [
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
        for name, edges in import_edges().items()
        for target, is_lazy, line in edges
        if is_lazy and (name, target) not in LAZY_ALLOWED
    ]
    assert not lazy, "imports inside functions:\n" + "\n".join(lazy)


def test_layers_only_import_downwards() -> None:
    bad = []
    for name, edges in import_edges().items():
        if not name.startswith("simdist"):
            continue
        outside = outside_package(name)
        for target, _, line in edges:
            if target.startswith(name + "."):
                continue
            where = f"{MODULES[name].relative_to(ROOT)}:{line}"
            if outside is not None:
                if not any(target == a or target.startswith(a + ".") for a in OUTSIDE[outside]):
                    bad.append(f"{where}: {name} ({outside}) imports {target}")
                continue
            mine, theirs = layer_of(name), layer_of(target)
            assert mine is not None, f"{name} belongs to no layer: add it to LAYERS or OUTSIDE"
            if theirs is None or theirs > mine:
                bad.append(f"{where}: {name} ({LAYERS[mine][0]}) imports {target} "
                           f"({'outside the chain' if theirs is None else LAYERS[theirs][0]})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    ("import simdist.engine.runner\n", [("simdist.engine.runner", False)]),
    ("def f():\n    from simdist.c10d import backend\n", [("simdist.c10d.backend", True)]),
    ("from . import schedule\n", [("simdist.algorithms.schedule", False)]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from simdist.comm import ops\n", []),
])
def test_the_scanner_finds_imports(tmp_path: Path, source: str, expected: list) -> None:
    path = tmp_path / "mod.py"
    path.write_text(source)
    found = [(t, lazy) for t, lazy, _ in imports("simdist.algorithms.registry", path, MODULES)]
    assert found == expected


def test_the_public_api_is_typed_not_lazy() -> None:
    import simdist

    assert not hasattr(simdist, "__getattr__")
    for name in simdist.__all__:
        assert getattr(simdist, name) is not None, name
    assert simdist.run.__module__ == "simdist.engine.runner"
    assert simdist.Cluster.__module__ == "simdist.network.cluster"


#: methods that change a list, set or dict in place
_MUTATORS = {"append", "extend", "insert", "remove", "clear", "add", "discard", "update", "pop", "setdefault"}


def writes_into_other_modules(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(attribute, module written, line) for each write of ``name``'s code into another simdist module's state:
    a call of its ``install_*`` function, an assignment to its attribute, an in-place change of one."""
    tree = parsed(path)
    modules: dict[str, str] = {}  # local name -> simdist module
    objects: dict[str, tuple[str, str]] = {}  # local name -> (simdist module, attribute)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in MODULES:
                    modules[a.asname or a.name] = full
                else:
                    objects[a.asname or a.name] = (node.module, a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    modules[a.asname] = a.name

    def owner(expr: ast.expr) -> tuple[str, str] | None:
        """(module, attribute) if ``expr`` is another simdist module's attribute or an object imported from one."""
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id in modules:
            return modules[expr.value.id], expr.attr
        if isinstance(expr, ast.Name) and expr.id in objects:
            return objects[expr.id]
        return None

    out = []
    for node in ast.walk(tree):
        found = None
        if isinstance(node, ast.Call):
            func = node.func
            target = owner(func)
            if target is not None and target[1].startswith("install_"):
                found = target
            elif isinstance(func, ast.Attribute) and func.attr in _MUTATORS:
                found = owner(func.value)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Attribute):
                    found = owner(t) or found
        if found is not None and found[0] != name:
            out.append((found[1], found[0], node.lineno))
    return sorted(out, key=lambda w: w[2])


def test_every_write_into_another_modules_state_is_a_declared_extension_point() -> None:
    declared = {(p.name, p.declared_in): p.filled_by for p in simdist.layers.EXTENSION_POINTS}
    used: set[tuple[str, str]] = set()
    bad = []
    for name, path in MODULES.items():
        for attr, module, line in writes_into_other_modules(name, path):
            fillers = declared.get((attr, module))
            if fillers is None or name not in fillers:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {name} writes {module}.{attr}")
            else:
                used.add((attr, module))
    assert not bad, "undeclared extension points (declare them in simdist.layers.EXTENSION_POINTS):\n" + "\n".join(bad)
    assert set(declared) == used, f"declared but never filled: {sorted(set(declared) - used)}"
    for point in simdist.layers.EXTENSION_POINTS:
        assert layer_of(point.declared_in) < min(layer_of(m) for m in point.filled_by), point


def test_the_scanner_sees_writes_into_other_modules(tmp_path: Path) -> None:
    path = tmp_path / "mod.py"
    path.write_text(
        "from simdist.c10d import process_group\nfrom simdist.c10d.process_group import ISSUE_OBSERVERS as OBS\n"
        "from simdist.engine.runner import install_report_writer\nimport simdist.engine.api as api\n"
        "process_group.ISSUE_OBSERVERS.append(print)\nOBS.remove(print)\ninstall_report_writer(print)\n"
        "api.now = None\nx = process_group.ISSUE_OBSERVERS[0]\n"
    )
    assert writes_into_other_modules("simdist.oracle.record", path) == [
        ("ISSUE_OBSERVERS", "simdist.c10d.process_group", 5),
        ("ISSUE_OBSERVERS", "simdist.c10d.process_group", 6),
        ("install_report_writer", "simdist.engine.runner", 7),
        ("now", "simdist.engine.api", 8),
    ]


def test_the_docs_layer_table_is_generated_from_simdist_layers() -> None:
    assert simdist.layers.markdown() in (ROOT / "docs" / "README.md").read_text()


def test_every_simdist_package_is_in_a_layer_or_outside_the_chain() -> None:
    for name in MODULES:
        if name.startswith("simdist"):
            assert layer_of(name) is not None or outside_package(name) is not None, name
