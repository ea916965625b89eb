"""`attention.mask` and its parameters: every mask family a run can pick from its config, each
refused before launch when a parameter is missing, out of range, set for a mask that does not
read it, or the recipe cannot train with it — naming the key and a fix that validates."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest

from flashcp import cli
from flashcp.config import AttentionConfig, build_config
from flashcp.launch import job
from flashcp.masks import DOCUMENT_MASKS
from flashcp.problems import ProblemsError
from helpers.paths import ROOT

TINY = {
    "model": {"preset": "tiny", "max_seq_len": 64},
    "data": {"seq_len": 64},
    "run": {"output_dir": "/nonexistent/run"},
}


def _raw(attention: dict[str, Any], recipe: str = "pretrain") -> dict[str, Any]:
    """The tiny config with `attention` (`"mtp": True`: on the tiny GLM with one trained MTP
    layer) under `recipe`."""
    attention = dict(attention)
    model = TINY["model"]
    if attention.pop("mtp", False):
        model = {"preset": "tiny_glm", "mtp_layers": 1, "mtp_loss_weight": 0.3}
    return {**TINY, "model": model, "attention": attention,
            "run": {**TINY["run"], "recipe": recipe}}  # fmt: skip


def test_the_config_offers_every_document_mask() -> None:
    """`attention.mask`'s choices are the masks the data pipeline builds, causal first (the
    default: runs from before the key train on exactly the mask they did)."""
    hints = typing.get_type_hints(AttentionConfig)
    assert typing.get_args(hints["mask"]) == DOCUMENT_MASKS
    assert AttentionConfig().mask == "causal"


GOOD = [
    ({"mask": "causal"}, "pretrain"),
    ({"mask": "sliding_window", "sliding_window": 16}, "pretrain"),
    ({"mask": "sliding_window", "sliding_window": 4096}, "sft"),  # wider than the sequence
    ({"mask": "global_window", "sliding_window": 8, "global_tokens": 2}, "sft"),
    ({"mask": "prefix_lm", "prefix_len": 16}, "pretrain"),
    ({"mask": "prefix_lm"}, "sft"),
    ({"mask": "causal"}, "dpo"),
    ({"mask": "sliding_window", "sliding_window": 8, "mtp": True}, "sft"),  # causal: no leak
]


@pytest.mark.parametrize(("attention", "recipe"), GOOD)
def test_valid_masks(attention: dict[str, Any], recipe: str) -> None:
    cfg = build_config(_raw(attention, recipe))
    assert cfg.attention.mask == attention["mask"]


BAD = [
    ({"mask": "banana"}, "pretrain", "attention.mask", r"expected one of 'causal', 'sliding"),
    (
        {"mask": "sliding_window"},
        "pretrain",
        "attention.sliding_window",
        r"needs attention\.sliding_window",
    ),
    (
        {"mask": "sliding_window", "sliding_window": 0},
        "pretrain",
        "attention.sliding_window",
        r"must be >= 1",
    ),
    (
        {"sliding_window": 16},
        "pretrain",
        "attention.sliding_window",
        r"read only with attention\.mask sliding_window or global_window.*is causal",
    ),
    (
        {"mask": "global_window", "sliding_window": 8},
        "pretrain",
        "attention.global_tokens",
        r"needs attention\.global_tokens >= 1",
    ),
    (
        {"mask": "sliding_window", "sliding_window": 8, "global_tokens": 2},
        "pretrain",
        "attention.global_tokens",
        r"read only with attention\.mask global_window",
    ),
    ({"mask": "prefix_lm"}, "pretrain", "attention.prefix_len", r"needs attention\.prefix_len"),
    ({"mask": "prefix_lm", "prefix_len": 0}, "pretrain", "attention.prefix_len", r">= 1 token"),
    (
        {"mask": "prefix_lm", "prefix_len": 64},
        "pretrain",
        "attention.prefix_len",
        r"leaves no trained token in a 64-token sequence.*e\.g\. 16",
    ),
    (
        {"mask": "prefix_lm", "prefix_len": 8},
        "sft",
        "attention.prefix_len",
        r"sft recipe each example's prefix is its prompt",
    ),
    ({"prefix_len": 8}, "pretrain", "attention.prefix_len", r"read only with attention\.mask"),
    (
        {"mask": "sliding_window", "sliding_window": 8},
        "dpo",
        "attention.mask",
        r"cannot be used with the dpo recipe.*share-question",
    ),
    (
        {"mask": "prefix_lm", "mtp": True},
        "sft",
        "attention.mask",
        r"trained multi-token prediction .* model\.mtp_loss_weight: 0",
    ),
]


@pytest.mark.parametrize(("attention", "recipe", "key", "match"), BAD)
def test_bad_masks_name_the_key(attention: dict[str, Any], recipe: str, key: str,
                                match: str) -> None:  # fmt: skip
    with pytest.raises(ProblemsError) as info:
        build_config(_raw(attention, recipe))
    errors = info.value.problems
    assert [e.key for e in errors] == [key], errors
    assert re.search(match, errors[0].message), errors[0].message


def test_flashcp_train_refuses_a_bad_mask_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`flashcp train`: exit 2, one line naming the key, nothing launched; the fix it names
    (the window it asks for) then validates."""

    def launched(*_: Any, **__: Any) -> None:
        raise AssertionError("the job was launched")

    monkeypatch.setattr(job, "launch_command", launched)
    config = str(ROOT / "configs" / "gpt" / "tiny_cp2.yaml")
    out = f"run.output_dir={tmp_path / 'run'}"
    code = cli.main(["train", config, "attention.mask=sliding_window", out])
    err = capsys.readouterr()
    text = (err.out + err.err).strip()
    assert code == 2, text
    assert "attention.sliding_window" in text and "e.g. 4096" in text
    assert not (tmp_path / "run").exists()
    fixed = ["attention.mask=sliding_window", "attention.sliding_window=4096", out]
    assert cli.main(["validate", config, *fixed]) == 0
