"""Layers import only downward: no import cycle between flashcp's packages and top-level
modules, counting every import (those inside functions too, which hide a cycle from Python
but not from a reader). docs/architecture.md draws the layers this graph allows."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import flashcp

SRC = Path(flashcp.__file__).resolve().parent


def unit_of(module: str) -> str:
    """`flashcp.models.base` → `models`; `flashcp.trainer` → `trainer`."""
    return module.split(".")[1]


def package_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Unit (package or top-level module) → the units it imports."""
    graph: dict[str, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        module = ".".join(("flashcp", *path.relative_to(src).with_suffix("").parts))
        if module == "flashcp.__init__":
            continue
        me = unit_of(module)
        edges = graph.setdefault(me, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "flashcp":
                    names = [f"flashcp.{a.name}" for a in node.names]
                elif node.module.startswith("flashcp."):
                    names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("flashcp.")]
            edges.update(unit_of(n) for n in names if unit_of(n) != me)
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one unit (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_packages() -> None:
    graph = package_graph()
    assert {"models", "attention", "trainer", "plan", "metrics"} <= set(graph)
    assert cycles(graph) == [], cycles(graph)


def test_a_cycle_is_found() -> None:
    """Negative control: one import back up (metrics → trainer) closes a cycle."""
    graph = package_graph()
    graph["metrics"] = graph["metrics"] | {"trainer"}
    assert any({"metrics", "trainer"} <= set(group) for group in cycles(graph))


def test_the_leaves_import_nothing_of_flashcp() -> None:
    """The bottom layer: the mask format, the FA dispatch, logging, faults, the device query,
    the launch attempt (faults fire in one attempt), the run directory's names (every layer
    asks them; the run lock only them and the refusal) and the refusal (`Problem`: every
    layer's checks speak it); the mask builders on the format alone."""
    graph = package_graph()
    for leaf in ("mask_indices", "device", "log", "attempt", "rundir", "problems"):
        assert graph[leaf] == set(), (leaf, graph[leaf])
    assert graph["masks"] == {"mask_indices"}, graph["masks"]
    assert graph["fa_dispatch"] <= {"log"} and graph["faults"] <= {"log", "attempt"}
    assert graph["runlock"] <= {"rundir", "problems"}


def test_the_optimizer_knows_no_model() -> None:
    """optim imports nothing of models (downward, but an optimizer that knows an architecture):
    the expert-parallel parameters reach it as data (`flashcp.optim.trainable.RowSlice`, from
    the trainer's `expert_rows`); docs/architecture.md states the rule."""
    graph = package_graph()
    assert "models" not in graph["optim"], sorted(graph["optim"])
    assert "optim imports nothing of models" in DOC.read_text()


DOC = SRC.parents[1] / "docs" / "architecture.md"


def trainer_parameters(source: str) -> list[str]:
    """`function(parameter)` for every parameter named `trainer` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None and arg.arg == "trainer":
                    found.append(f"{getattr(node, 'name', 'lambda')}({arg.arg})")
    return found


def test_no_module_below_the_trainer_takes_the_trainer() -> None:
    """What a lower module needs of a run comes as typed data (`run_info.RunStart`,
    `faults.install`'s model, parameters and step counter), never the trainer as `Any` read
    attribute by attribute: that dependency has no import, so this file could not see it
    (docs/architecture.md, "What the layer test cannot see")."""
    found = {
        str(path.relative_to(SRC)): hits
        for path in sorted(SRC.rglob("*.py"))
        if path != SRC / "trainer.py" and (hits := trainer_parameters(path.read_text()))
    }
    assert found == {}
    # negative control: the old start line's signature is found
    assert trainer_parameters("def banner(trainer: Any) -> str: ...") == ["banner(trainer)"]
    assert "What the layer test cannot see" in DOC.read_text()


def test_the_doc_names_this_test_and_only_units_that_exist() -> None:
    """The diagram matches the tree both ways (`test_imports_go_down_the_documented_layers`:
    every unit is drawn; here: every drawn unit exists), and the doc gives this file's path."""
    text = DOC.read_text()
    here = Path(__file__).resolve()
    assert str(here.relative_to(SRC.parents[1])) in text
    drawn = set(documented_layers(text))
    assert drawn - set(package_graph()) == set()
    # negative control: a unit drawn but gone from the tree is found
    stale = text.replace("rank_setup.py ", "rank_setup.py · gone.py ", 1)
    assert set(documented_layers(stale)) - set(package_graph()) == {"gone"}


def documented_layers(text: str) -> dict[str, int]:
    """Unit → its line in the diagram under "## Package layers" (0 = the bottom line)."""
    block = text.split("## Package layers", 1)[1].split("```", 2)[1]
    lines = [line for line in block.splitlines() if line.strip()]
    layers: dict[str, int] = {}
    for height, line in enumerate(reversed(lines)):
        names = line.split("  ")[0].split("·")
        for name in names:
            unit = name.strip().removesuffix("/").removesuffix(".py")
            layers[unit] = height
    return layers


def downward_violations(graph: Mapping[str, set[str]], layers: Mapping[str, int]) -> list[str]:
    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a])
            if layers[b] >= layers[a]]  # fmt: skip


def test_imports_go_down_the_documented_layers() -> None:
    graph = package_graph()
    layers = documented_layers(DOC.read_text())
    assert set(graph) <= set(layers), f"not in the diagram: {sorted(set(graph) - set(layers))}"
    assert downward_violations(graph, layers) == []
    # negative control: the diagram with trainer drawn below recipes is refused
    moved = dict(layers, trainer=layers["recipes"] - 1)
    assert "trainer -> recipes" in downward_violations(graph, moved)
