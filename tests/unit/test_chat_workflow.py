"""A researcher's path in one process, per GLM architecture: a test-sized Hugging Face directory
(tiny GLM-4 / GLM-4.5 MoE weights + config.json + a generated tokenizer with a GLM-4-style chat
template) → `model.from_pretrained` → SFT on messages → export → DPO on preference messages
from that export → export → reload with identical logits and the same tokenizer. Both runs
evaluate on held-out sets (`eval.path`, `eval.every`: held-out loss in SFT, reward accuracy and
margins in DPO) and report to VisualDL besides metrics.jsonl (`run.report_to`), whose logs,
read back with VisualDL's `LogReader`, hold the same scalars."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest

from bench.hfdir import (
    DEFAULT_VOCAB,
    chat_records,
    preference_records,
    write_jsonl,
    write_tokenizer_files,
)
from flashcp import masks, rundir
from flashcp.attention.context import AttentionContext
from flashcp.checkpoint.export import export_run
from flashcp.config import build_config
from flashcp.data import HFTokenizer
from flashcp.metrics.writer import read_metrics, scalars
from flashcp.models import build_model, preset
from flashcp.models.hf_config import hf_config
from flashcp.models.hf_save import save_hf_checkpoint
from flashcp.parallelize import default_model_factory
from flashcp.trainer import Trainer
from helpers.configs import Sections, merged, tiny_config
from helpers.trainruns import fit

WORKFLOW: Sections = {
    "data": {"seq_len": 128, "micro_batch_size": 2},
    "train": {"steps": 8, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1, "seed": 1},
    "checkpoint": {"every": 8},
    "run": {"device": "cpu", "report_to": ["jsonl", "visualdl"]},
}
"""Eight steps on the CPU, a checkpoint at the end, metrics in VisualDL too."""


def _train(model_dir: Path, data: Path, out: Path, recipe: str, **extra: Any) -> Trainer:
    """`recipe` on `data` from the checkpoint in `model_dir` into `out` (`extra` sections
    over `WORKFLOW`)."""
    start = {"model": {"from_pretrained": str(model_dir)}, "data": {"path": str(data)},
             "run": {"recipe": recipe, "output_dir": str(out)}}  # fmt: skip
    cfg = tiny_config(base=merged(WORKFLOW, **start), **extra)
    assert cfg.data.tokenizer == str(model_dir)  # the directory's tokenizer by default
    return fit(cfg).trainer


def _logits(model: paddle.nn.Layer, ids: np.ndarray) -> np.ndarray:
    b, s = ids.shape
    pos = paddle.arange(s, dtype="int64").unsqueeze(0).expand([b, s])
    ctx = AttentionContext(mask=masks.causal_mask(b, s).indices, causal=True)
    with paddle.no_grad():
        return model.logits(model(paddle.to_tensor(ids), pos, ctx)).numpy()


def _evals(run: Path, steps: list[int]) -> list[dict[str, Any]]:
    """The records of `run` that evaluated (at `steps`), every `eval/` value finite."""
    rows = [r for r in read_metrics(run) if "eval/loss" in r]
    assert [r["step"] for r in rows] == steps
    for r in rows:
        values = {k: v for k, v in r.items() if k.startswith("eval/")}
        assert all(math.isfinite(v) for v in values.values()), values
    # one pass over the whole held-out set each time: the same packed rows and batches
    assert len({(r["eval/rows"], r["eval/batches"]) for r in rows}) == 1
    return rows


def _check_visualdl(run: Path, tags: set[str]) -> None:
    """The run's VisualDL log holds every scalar of metrics.jsonl (`tags` among them), step for
    step, with its value (VisualDL stores float32)."""
    from visualdl import LogReader

    (log,) = (run / rundir.VISUALDL_DIR).glob("vdlrecords.*.log")
    want: dict[str, dict[int, float]] = {}
    for record in read_metrics(run):
        for tag, value in scalars(record).items():
            want.setdefault(tag, {})[record["step"]] = value
    reader = LogReader(file_path=str(log))
    assert tags <= set(want) and set(reader.get_tags()["scalar"]) == set(want)
    for tag, values in want.items():
        got = {int(e.id): e.value for e in reader.get_data("scalar", tag)}
        assert got.keys() == values.keys(), tag
        for step, value in values.items():
            assert got[step] == pytest.approx(float(np.float32(value)), rel=1e-6, abs=1e-30), tag


@pytest.mark.parametrize("name", ["tiny_glm", "tiny_glm_moe"])
def test_directory_sft_dpo_export_reload(tmp_path: Path, name: str) -> None:
    args = preset(name, vocab_size=DEFAULT_VOCAB, max_seq_len=256)
    base = tmp_path / "base"
    save_hf_checkpoint(build_model(args, seed=5), base)
    (base / "config.json").write_text(json.dumps(hf_config(args), indent=1))
    write_tokenizer_files(base)
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_records(24))
    prefs = write_jsonl(tmp_path / "pref.jsonl", preference_records(24, as_messages=True))
    # held out: no pair of the shipped set is in both (training uses pairs 0-30 / 0-23)
    chat_eval = write_jsonl(tmp_path / "chat_eval.jsonl", chat_records(8, start=31))
    prefs_eval = write_jsonl(tmp_path / "pref_eval.jsonl",
                             preference_records(8, as_messages=True, start=24))  # fmt: skip

    _train(base, chat, tmp_path / "sft", "sft", eval={"path": str(chat_eval), "every": 4})
    sft_losses = [r["loss"] for r in read_metrics(tmp_path / "sft")]
    assert np.mean(sft_losses[-2:]) < np.mean(sft_losses[:2]) - 0.3, sft_losses
    early, last = _evals(tmp_path / "sft", [4, 8])  # every 4 steps, the last one included
    # held-out loss: below a uniform guess over the vocabulary, falling as training goes on
    assert last["eval/loss"] < early["eval/loss"] < math.log(DEFAULT_VOCAB)
    assert last["eval/perplexity"] == pytest.approx(math.exp(last["eval/loss"]), rel=1e-12)
    assert early["eval/targets"] == last["eval/targets"] > 8  # the assistant tokens, each pass
    _check_visualdl(tmp_path / "sft", {"loss", "lr", "grad_norm", "eval/loss"})
    sft_hf = tmp_path / "sft_hf"
    report = export_run(tmp_path / "sft", sft_hf)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(report.tokenizer_files)

    dpo = _train(
        sft_hf,
        prefs,
        tmp_path / "dpo",
        "dpo",
        dpo={"beta": 0.1},
        train={"steps": 12, "lr": 1e-3, "min_lr": 1e-4},
        checkpoint={"every": 12},
        eval={"path": str(prefs_eval), "every": 6},
    )
    dpo_losses = [r["loss"] for r in read_metrics(tmp_path / "dpo")]
    assert dpo_losses[0] == pytest.approx(math.log(2))  # policy == reference (the SFT model)
    assert np.mean(dpo_losses[-3:]) < math.log(2) - 0.05, dpo_losses
    dpo_evals = _evals(tmp_path / "dpo", [6, 12])
    # the held-out preference loss falls below the untrained log 2 as training goes on
    assert dpo_evals[1]["eval/loss"] < dpo_evals[0]["eval/loss"] < math.log(2)
    for r in dpo_evals:
        assert r["eval/examples"] == 8 and r["eval/rewards/accuracy"] * 8 in range(9)
        margin = r["eval/rewards/margin"]
        assert margin == pytest.approx(r["eval/rewards/chosen"] - r["eval/rewards/rejected"],
                                       rel=1e-9, abs=1e-12)  # fmt: skip
        # sigmoid DPO: mean(-log σ(m_i)) >= -log σ(mean m_i) (convexity)
        assert r["eval/loss"] >= math.log1p(math.exp(-margin)) - 1e-9
        assert r["eval/logps/chosen"] < 0 and r["eval/logps/rejected"] < 0
    _check_visualdl(tmp_path / "dpo", {"loss", "rewards/accuracy", "eval/rewards/accuracy",
                                       "eval/rewards/margin"})  # fmt: skip
    final = tmp_path / "final_hf"
    export_run(tmp_path / "dpo", final)

    reloaded = default_model_factory(
        build_config({"model": {"from_pretrained": str(final)}, "data": {"seq_len": 32}})
    )
    ids = np.random.default_rng(0).integers(0, DEFAULT_VOCAB, (2, 24))
    np.testing.assert_array_equal(_logits(reloaded, ids), _logits(dpo.model, ids))
    conv = chat_records(2)[1]["messages"]
    assert HFTokenizer(final).render_chat(conv) == HFTokenizer(base).render_chat(conv)
    assert HFTokenizer(final).encode("[gMASK]<sop>") == HFTokenizer(base).encode("[gMASK]<sop>")
