"""A model family is one file: no module outside `flashcp.models.families` compares `arch` to a
family's name (so adding a family touches only its file), and registering a `Family` is all it
takes for the builder, the config.json reader and writer, the planner's inventory and the
FLOP counter to know it."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from flashcp.models.families import FAMILIES, names, register

SRC = Path(__file__).resolve().parents[3] / "src" / "flashcp"
FAMILY_DIR = SRC / "models" / "families"


def _names_in(node: ast.AST) -> set[str]:
    """String constants of `node` (itself, or the items of a tuple / list / set literal)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names_in(e) for e in node.elts)) if node.elts else set()
    return set()


def _is_arch(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "arch") or (
        isinstance(node, ast.Name) and node.id == "arch"
    )


def arch_comparisons(source: str, families: set[str]) -> Iterator[int]:
    """Lines of `source` comparing an ``arch`` (name or attribute) with a family's name."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_arch(o) for o in operands) and any(
                _names_in(o) & families for o in operands
            ):
                yield node.lineno
        elif (
            isinstance(node, ast.match_case)
            and isinstance(node.pattern, ast.MatchValue)
            and _names_in(node.pattern.value) & families
        ):
            yield node.pattern.lineno


def test_no_module_outside_the_families_compares_arch_to_a_family_name() -> None:
    families = set(names())
    found = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        if FAMILY_DIR not in path.parents
        for line in arch_comparisons(path.read_text(), families)
    ]
    assert not found, f"arch compared to a family's name outside models/families: {found}"


@pytest.mark.parametrize(
    "snippet",
    ['if args.arch == "glm":\n    pass', 'x = cfg.model.arch in ("glm", "glm_moe")',
     'ok = "llama" != arch', 'match 1:\n    case "qwen3":\n        pass'],  # fmt: skip
)
def test_the_scan_finds_a_planted_comparison(snippet: str) -> None:
    assert list(arch_comparisons(snippet, set(names())))


def test_registering_a_family_is_all_it_takes() -> None:
    """A family no module has heard of (Qwen3 under another name): built, read from and
    written to config.json, counted by the planner and the FLOP counter, all from its one
    `Family`."""
    from flashcp.models import build_model
    from flashcp.models.families.inventory import parameter_count
    from flashcp.models.hf_config import args_from_hf_config, hf_config
    from flashcp.plan.params import stage_parameters

    qwen3 = FAMILIES["qwen3"]
    assert qwen3.hf is not None
    toy_hf = dataclasses.replace(qwen3.hf, architecture="ToyForCausalLM", model_type="toy")
    tiny = dataclasses.replace(qwen3.presets["tiny_qwen3"].args, arch="toy")
    toy = dataclasses.replace(qwen3, arch="toy", title="a toy", hf=toy_hf, presets={})
    register(toy)
    try:
        model = build_model(tiny, seed=0)
        params = {n: tuple(p.shape) for n, p in model.named_parameters()}
        assert {s.name: s.shape for s in stage_parameters(tiny, 0, 1)} == params
        assert parameter_count(tiny) == sum(int(_numel(s)) for s in params.values())
        written = hf_config(tiny)
        assert written["architectures"] == ["ToyForCausalLM"] and written["model_type"] == "toy"
        assert args_from_hf_config(written) == dataclasses.replace(
            tiny, max_seq_len=written["max_position_embeddings"]
        )
        assert tiny.matmul_weights() > 0
    finally:
        FAMILIES.pop("toy")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
