"""Placeholder paths (`/path/to/...`, `flashcp.config.placeholders`): refused by everything that
trains with the key and what to put there, accepted by `flashcp validate`'s static check (the
model then comes from the section's own keys), and never followed by errors about the same
key (a missing file, a missing tokenizer)."""

from __future__ import annotations

from typing import Any

import pytest

from flashcp.config import build_config, collect
from flashcp.config.placeholders import (
    data_format,
    find_placeholders,
    is_placeholder,
    placeholder_message,
    what_to_put,
)
from flashcp.models import preset
from flashcp.problems import ProblemsError


def _raw(**sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {"model": {"preset": "tiny"}, "run": {"device": "cpu"}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def test_what_counts_as_a_placeholder() -> None:
    assert is_placeholder("/path/to/GLM-4-9B-0414") and not is_placeholder("/path/toys")
    assert not is_placeholder(None) and not is_placeholder(3)
    raw = {"model": {"from_pretrained": "/path/to/m", "hidden_size": 8}, "max_steps": 3,
           "data": {"path": "/data/real.jsonl", "tokenizer": "/path/to/tok"}}  # fmt: skip
    assert find_placeholders(raw) == [("model.from_pretrained", "/path/to/m"),
                                      ("data.tokenizer", "/path/to/tok")]  # fmt: skip


def test_what_to_put_follows_the_recipe_and_its_field_names() -> None:
    assert "documents with a 'text' field" in data_format({})
    assert "'body' field" in data_format({"data": {"text_field": "body"}})
    sft = data_format({"run": {"recipe": "sft"}, "data": {"messages_field": "conversation"}})
    assert 'a \'conversation\' list of {"role", "content"} messages per record' in sft
    assert "'prompt'/'response' strings" in sft
    dpo = data_format({"run": {"recipe": "dpo"}, "data": {"chosen_field": "good"}})
    assert "'prompt', 'good' and 'rejected' strings" in dpo
    assert "tokenizer.json + tokenizer_config.json" in what_to_put("model.from_pretrained", {})
    assert "model.from_pretrained's tokenizer" in what_to_put("data.tokenizer", {})
    assert "safetensors checkpoint" in what_to_put("checkpoint.init_from", {})
    assert what_to_put("run.output_dir", {}) == "a real path"
    assert what_to_put("eval.path", {}).startswith("held-out data in the training data's format")
    message = placeholder_message("data.path", "/path/to/x.jsonl", {})
    assert message.startswith(
        "'/path/to/x.jsonl' is a placeholder still to fill in (in the file, or as "
        "data.path=PATH on the command line) with a JSON"
    )


def test_refused_with_every_key_named_and_nothing_else_about_them() -> None:
    raw = _raw(
        data={"path": "/path/to/data.jsonl", "tokenizer": "/path/to/tok"},
        eval={"path": "/path/to/eval.jsonl"},
        checkpoint={"init_from": "/path/to/ckpt", "resume": "/path/to/run/step_4"},
        run={"output_dir": "/path/to/out"},
    )
    with pytest.raises(ProblemsError) as refused:
        build_config(raw)
    keys = ["checkpoint.init_from", "checkpoint.resume", "data.path", "data.tokenizer",
            "eval.path", "run.output_dir"]  # fmt: skip
    assert sorted(e.key for e in refused.value.problems) == keys  # one each, no "no file at"
    assert all("is a placeholder still to fill in" in e.message for e in refused.value.problems)
    cfg, errors = collect(raw, allow_placeholders=True)  # the static check accepts them
    assert errors == [] and cfg is not None and cfg.data.path == "/path/to/data.jsonl"


def test_placeholder_model_directory_leaves_the_model_to_the_section() -> None:
    """What `flashcp validate` and a pre-launch plan see of an unfilled recipe: the stated
    shape; the directory's tokenizer and weights are neither looked for nor loaded."""
    model = {"from_pretrained": "/path/to/GLM", "arch": "glm", "vocab_size": 512,
             "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "qkv_bias": True,
             "partial_rotary_factor": 0.5, "intermediate_size": 128}  # fmt: skip
    raw = _raw(data={"path": "/path/to/chat.jsonl"}, run={"recipe": "sft"})
    raw["model"] = model
    cfg, errors = collect(raw, allow_placeholders=True)
    assert errors == [] and cfg is not None
    assert cfg.model == preset("tiny_glm", vocab_size=512)
    assert cfg.model_from_pretrained == "/path/to/GLM" == cfg.data.tokenizer
    assert cfg.checkpoint.init_from is None
    _, errors = collect(raw)
    assert [e.key for e in errors] == ["model.from_pretrained", "data.path"]
    assert "'messages' list" in errors[1].message  # the sft recipe's data
    # a real problem next to a placeholder is still reported
    _, errors = collect({**raw, "model": {**model, "num_kv_heads": 3}}, allow_placeholders=True)
    assert [e.key for e in errors] == ["model.num_heads"]
