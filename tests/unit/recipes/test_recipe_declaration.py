"""A recipe is declared once (`flashcp.config.recipe_spec.RecipeSpec`), and everyone asks that
declaration: a toy recipe registered here, from outside `src/`, is a valid `run.recipe` with its
own section and rules (the loader, `flashcp validate`), reads the formats it lists (the
`data.format` table, format detection, the placeholder's sentence), and its class is what the
trainer builds and `flashcp data-stats` reads the data of. The built-in declarations are
checked for what the import-time asserts used to keep equal: every format a recipe lists has a
reader of its kind, every reader is listed by a recipe, every class resolves."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flashcp import cli
from flashcp.config import (
    RECIPES,
    RecipeSpec,
    build_config,
    collect,
    data_formats,
)
from flashcp.config.checks import Checks
from flashcp.config.schema import Config
from flashcp.data.dataset import DocumentBuilder
from flashcp.data.formats import FORMATS, DataFormatError, detect, formats_of
from flashcp.data.records import BadRecordError
from flashcp.data.tokenizer import build_tokenizer
from flashcp.recipes import build_recipe, recipe_class
from helpers.configs import TINY_LM, merged

TOY_NAME = "toy_lm"


@dataclass(kw_only=True)
class ToyConfig:
    """The toy recipe's section."""

    scale: float = 1.0
    """Multiplier of the LM loss (> 0)."""


def check_toy(cfg: Config, c: Checks) -> None:
    """The toy recipe's rules: a positive scale, and no prefix (it trains every token)."""
    toy = cfg.extras.get("toy")
    if toy is not None and not toy.scale > 0:
        c.add("toy.scale", f"must be > 0, got {toy.scale}")
    if cfg.attention.mask == "prefix_lm":
        c.add("attention.mask", "prefix_lm cannot be used with the toy_lm recipe", "run.recipe")


TOY = RecipeSpec(
    TOY_NAME,
    "a test's recipe: the LM loss on text rows, scaled",
    sections={"toy": ToyConfig},
    examples="text",
    formats=("text",),
    rules=(check_toy,),
    implementation="helpers.toy_recipe:ToyRecipe",
)


def _raw(recipe: str = TOY_NAME, **sections: dict[str, Any]) -> dict[str, Any]:
    return merged(TINY_LM, run={"recipe": recipe, "output_dir": "/nonexistent/run"}, **sections)


def _errors(raw: dict[str, Any]) -> list[tuple[str, str]]:
    return [(e.key, e.message) for e in collect(raw)[1]]


def test_a_recipe_declared_once_is_known_everywhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # undeclared: unknown to every one of them
    assert [k for k, _ in _errors(_raw())] == ["run.recipe"]
    assert TOY_NAME not in data_formats()["text"] and formats_of(TOY_NAME) == ()
    with pytest.raises(ValueError, match="run.recipe 'toy_lm' has no trainer recipe"):
        recipe_class(TOY_NAME)

    monkeypatch.setitem(RECIPES, TOY_NAME, TOY)
    # the loader: run.recipe and its section, which is its own
    cfg = build_config(_raw(toy={"scale": 2.0}))
    assert cfg.run.recipe == TOY_NAME and cfg.extras["toy"].scale == 2.0
    assert _errors(_raw("pretrain", toy={"scale": 2.0})) == [
        ("toy", "section is read only by recipe(s) toy_lm: set run.recipe=toy_lm, or set "
                "toy=null")]  # fmt: skip
    # validate: its rules, under it only
    assert _errors(_raw(toy={"scale": 0.0})) == [("toy.scale", "must be > 0, got 0.0")]
    prefix = {"mask": "prefix_lm", "prefix_len": 8}
    assert [k for k, _ in _errors(_raw(attention=prefix))] == ["attention.mask"]
    assert _errors(_raw("pretrain", attention=prefix)) == []
    # the data.format table
    assert data_formats()["text"] == ("pretrain", TOY_NAME)
    assert TOY_NAME in data_formats()["auto"]
    assert _errors(_raw(data={"format": "messages"})) == [
        ("data.format", "messages is a format of run.recipe sft, not toy_lm: set data.format to "
                        "one of auto, text")]  # fmt: skip
    assert build_config(_raw(data={"format": "text"})).data.format == "text"
    # format detection and the placeholder's sentence
    assert formats_of(TOY_NAME) == formats_of("pretrain")
    assert detect([{"text": "a document"}], recipe=TOY_NAME).name == "text"
    chat = [{"messages": [{"role": "user", "content": "Q"}]}]
    with pytest.raises(DataFormatError, match=r"run\.recipe toy_lm reads \(`text`: a string\)"
                                              r".*set run\.recipe=sft"):  # fmt: skip
        detect(chat, recipe=TOY_NAME)
    (placeholder,) = _errors(_raw(data={"path": "/path/to/docs.jsonl"}))
    assert "documents with a 'text' field" in placeholder[1]
    # the trainer's lookup: the class the declaration names
    toy_class = recipe_class(TOY_NAME)
    assert (toy_class.__module__, toy_class.__name__) == ("helpers.toy_recipe", "ToyRecipe")
    recipe = build_recipe(cfg, None)  # type: ignore[arg-type]  # groups: unused until data()
    assert type(recipe) is toy_class and recipe.scale == 2.0  # type: ignore[attr-defined]
    # `flashcp data-stats`: the recipe's data class on its (built-in) text
    config = tmp_path / "toy.yaml"
    config.write_text(f"model: {{preset: tiny, max_seq_len: 64}}\ndata: {{seq_len: 64}}\n"
                      f"run: {{recipe: {TOY_NAME}}}\ntoy: {{scale: 2.0}}\n")  # fmt: skip
    assert cli.main(["data-stats", str(config), "--steps", "1", "--json"]) == 0
    (step,) = json.loads(capsys.readouterr().out)["steps"]
    assert sum(sum(row) for mb in step["ranks"][0]["micro_batches"] for row in mb["rows"]) > 0


def test_the_builtin_declarations_are_complete() -> None:
    """What the import-time asserts kept equal, now derived: each recipe's formats have a
    reader of its kind of example, each reader serves a recipe, each class resolves and is
    the recipe it is declared as."""
    assert list(RECIPES) == ["pretrain", "sft", "dpo"]
    served = set()
    for name, spec in RECIPES.items():
        readers = formats_of(name)
        assert [f.name for f in readers] == list(spec.formats)
        assert all(f.examples == spec.examples for f in readers)
        served |= {(f.name, f.examples) for f in readers}
        assert recipe_class(name).name == name
    assert served == {(f.name, f.examples) for f in FORMATS}
    assert data_formats()["paddleformers"] == ("sft", "dpo")


def test_a_format_without_a_reader_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A declaration listing a format no reader serves for its kind fails when its formats are
    asked for, naming them (not a silent empty list)."""
    bad = RecipeSpec("bad", "a test's", examples="preference", formats=("text", "preference"))
    monkeypatch.setitem(RECIPES, "bad", bad)
    with pytest.raises(ValueError, match="run.recipe bad lists data format.s. text, which have "
                                         "no reader of preference examples"):  # fmt: skip
        formats_of("bad")


def test_the_data_reader_reads_what_the_declaration_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LM data's record reader asks the declaration too: a supervised recipe listing only
    `prompt_response` reads those rows (prompt untrained, response trained) and refuses a chat
    row that sft itself would read, naming its one format."""
    monkeypatch.setitem(RECIPES, "toy_sft", RecipeSpec(
        "toy_sft", "a test's", examples="supervised", formats=("prompt_response",)))  # fmt: skip
    build = DocumentBuilder(build_tokenizer("byte"), recipe="toy_sft")
    doc = build({"prompt": "Q?", "response": "A."})
    assert doc.targets.sum() == len("A.") + 1  # the response and EOS
    chat = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    with pytest.raises(BadRecordError, match=r"an toy_sft record needs one of: `prompt`, "
                                              r"`response` strings \(no chat template\)"):
        build(chat)
