"""Held-out evaluation (`eval.*`, `flashcp.evaluation.evaluator`) in one process.

* The eval loss equals an independent computation: the trained model's full float32 logits on
  the same eval sequences, `paddle.nn.functional.cross_entropy` summed and divided by the
  target count (no chunked head, no recipe code) — within the float32 rule of
  `bench.numerics`; the stale model's eval (one step earlier) is rejected by that rule.
* DPO: eval loss, rewards and accuracy equal `dpo_terms` on `answer_logps` of the policy
  (LoRA adapters on) and the reference (adapters off), batch by batch.
* Training is bitwise the same with and without eval (losses and gradient norms), also with
  LoRA dropout drawing random numbers during training, and for DPO.
* One pass over the eval set, `eval.max_batches`, and when evaluation runs.
* Every eval document counts once, packed or not: a one-document set is one row of its own
  targets, and packed and unpacked evaluation of one model give the same targets and, within
  the float32 rule, the same loss.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from bench import numerics
from flashcp.attention.context import AttentionContext
from flashcp.config import build_config
from flashcp.data.dpo_stream import DPOData
from flashcp.data.sources import BUILTIN_CORPUS, read_records
from flashcp.evaluation.evaluator import (
    Evaluator,
    data_epoch,
    format_eval,
    is_due,
    pass_rows,
    run_if_due,
    training_evaluator,
)
from flashcp.lora.model import disable_adapters
from flashcp.metrics.writer import read_metrics
from flashcp.rank_setup import step_groups
from flashcp.recipes import build_recipe
from flashcp.recipes.dpo_loss import answer_logps, dpo_terms
from flashcp.recipes.lm import LMData
from flashcp.trainer import Trainer
from helpers.configs import TINY_GLM, TINY_LM, Sections, TinyCfg, merged, tiny_config
from helpers.paths import ROOT
from helpers.trainruns import Fit

DPO_FILE = ROOT / "src" / "flashcp" / "data" / "dpo_default.jsonl"


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def tiny_base() -> Sections:
    """Three steps, one of warmup, no checkpoints."""
    return merged(TINY_LM, train={"steps": 3, "warmup_steps": 1}, checkpoint={"every": 0})


@pytest.fixture
def text_eval(tmp_path: Path) -> Path:
    """11 held-out documents (the last of the shipped corpus: not what training starts on)."""
    return _write_jsonl(tmp_path / "eval.jsonl", read_records(BUILTIN_CORPUS)[-11:])


def _training(run: Any) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(run.run.output_dir)]


def _eval_cfg(cfg: Any) -> Any:
    """The eval set read one row at a time, in file order."""
    return replace(
        cfg,
        data=replace(cfg.data, path=cfg.eval.path, shuffle=False, micro_batch_size=1),
        train=replace(cfg.train, grad_accum=1),
    )


# -- pretrain / sft ---------------------------------------------------------------------------


@pytest.mark.equivalence
def test_eval_loss_equals_the_models_own_loss_on_the_eval_set(
    tmp_path: Path,
    text_eval: Path,
    tiny_cfg: TinyCfg,
    fit: Fit,
) -> None:
    cfg = tiny_cfg(tmp_path, train={"steps": 2}, eval={"path": str(text_eval), "every": 1})
    trainer, _, out = fit(cfg)
    rows = read_metrics(cfg.run.output_dir)
    assert [r["step"] for r in rows] == [1, 2] and all("eval/loss" in r for r in rows)
    assert "eval step 1 | loss " in out and f"eval {text_eval}:" in out
    last = rows[-1]
    # independent: the trained model's full logits on the same sequences, paddle's CE
    data = LMData(_eval_cfg(cfg), one_pass=True)
    model = trainer.model
    model.eval()
    nll, targets = 0.0, 0
    with paddle.no_grad():
        for _ in range(int(last["eval/rows"])):
            for batch in data.next_step():
                attn = AttentionContext(mask=batch.mask.indices, causal=batch.mask.causal)
                hidden = model(
                    paddle.to_tensor(batch.input_ids), paddle.to_tensor(batch.positions), attn
                )
                logits = model.logits(hidden)
                labels = paddle.to_tensor(batch.labels)
                loss = F.cross_entropy(
                    logits.reshape([-1, logits.shape[-1]]), labels.reshape([-1, 1]),
                    ignore_index=-100, reduction="sum",
                )  # fmt: skip
                nll += float(loss)
                targets += batch.num_targets
    assert last["eval/targets"] == targets > 1000
    want = nll / targets
    numerics.assert_close(last["eval/loss"], want, n=targets, scale=want, what="eval/loss")
    assert last["eval/perplexity"] == pytest.approx(np.exp(last["eval/loss"]), rel=1e-12)
    # negative control: the eval of one step earlier (other weights) fails the same rule
    numerics.assert_rejects(rows[0]["eval/loss"], want, n=targets, scale=want)
    # one pass: every sequence of the eval set's first epoch once, 2 per batch
    stream = LMData(_eval_cfg(cfg), one_pass=True).stream
    sequences = 0
    while stream.state.epoch == 0:
        stream.next()
        sequences += 1
    assert last["eval/rows"] == sequences >= 5 and sequences % 2 == 1  # a short last batch
    assert last["eval/batches"] == (sequences + 1) // 2


def test_training_is_bitwise_the_same_with_and_without_eval(
    tmp_path: Path,
    text_eval: Path,
    tiny_cfg: TinyCfg,
    fit: Fit,
) -> None:
    """SFT with LoRA dropout (training draws random numbers each step) and 2 micro-batches:
    evaluating after every step changes none of training's losses or gradient norms."""
    sft_eval = _write_jsonl(
        tmp_path / "sft_eval.jsonl",
        [{"prompt": f"Question {i}?", "response": f"Answer number {i}."} for i in range(6)],
    )
    common = {
        "run": {"recipe": "sft"},
        "lora": {"rank": 4, "dropout": 0.2},
        "data": {"micro_batch_size": 1},
        "train": {"grad_accum": 2},
    }
    plain = tiny_cfg(tmp_path / "plain", **common)
    evald = tiny_cfg(tmp_path / "eval", **common, eval={"path": str(sft_eval), "every": 1})
    fit(plain)
    out = fit(evald).out
    assert _training(evald) == _training(plain)
    rows = read_metrics(evald.run.output_dir)
    for r in rows:  # the responses' tokens (16 bytes each) are targets, not the prompts'
        assert 6 * 16 <= r["eval/targets"] < r["eval/rows"] * 64 - 6 * 8
    assert "eval step 3" in out


def test_max_batches_and_when_eval_runs(
    tmp_path: Path, text_eval: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    cfg = tiny_cfg(
        tmp_path, train={"steps": 5},
        eval={"path": str(text_eval), "every": 2, "max_batches": 2},
    )  # fmt: skip
    trainer = fit(cfg).trainer
    rows = read_metrics(cfg.run.output_dir)
    assert [r["step"] for r in rows if "eval/loss" in r] == [2, 4, 5]  # and after the last
    assert {r["eval/batches"] for r in rows if "eval/loss" in r} == {2.0}
    # the same model evaluated twice gives the same result: every eval starts at the set's start
    again = trainer.evaluate()
    assert again["eval/loss"] == rows[-1]["eval/loss"]
    only_end = tiny_cfg(tmp_path / "end", train={"steps": 2}, eval={"path": str(text_eval)})
    fit(only_end)
    assert [("eval/loss" in r) for r in read_metrics(only_end.run.output_dir)] == [False, True]


SFT_PAIRS = [("Hi there?", "Hello world")] + [
    (f"Question {i} is here?", "Answer " + "x" * (3 + 2 * i)) for i in range(8)
]
"""(prompt, response) pairs; with the byte tokenizer a record is BOS + prompt + response +
EOS, its targets the response's bytes and EOS. The first: 22 tokens, 12 targets."""


def _targets(pairs: list[tuple[str, str]]) -> int:
    """The targets of `pairs`, counted from their text (response bytes + EOS each)."""
    return sum(len(response.encode()) + 1 for _, response in pairs)


@pytest.mark.equivalence
def test_every_eval_document_counts_once_packed_or_not(
    tmp_path: Path, tiny_cfg: TinyCfg, fit: Fit
) -> None:
    """Packed eval rows hold each document once and whole (they used to be filled by
    repeating the set: one 22-token conversation with 12 targets reported 136 targets), so a
    packed and an unpacked pass of the same trained model count the same targets and agree
    on the loss within the float32 rule."""
    one = _write_jsonl(tmp_path / "one.jsonl", [{"prompt": p, "response": r}
                                                for p, r in SFT_PAIRS[:1]])  # fmt: skip
    many = _write_jsonl(tmp_path / "many.jsonl", [{"prompt": p, "response": r}
                                                  for p, r in SFT_PAIRS[1:]])  # fmt: skip
    assert len(b"Hi there?Hello world") + 2 == 22 and _targets(SFT_PAIRS[:1]) == 12
    cfg = tiny_cfg(tmp_path, run={"recipe": "sft"}, train={"steps": 1},
                   eval={"path": str(one)}, checkpoint={"every": 0})  # fmt: skip
    trainer = fit(cfg).trainer
    last = read_metrics(cfg.run.output_dir)[-1]
    assert (last["eval/rows"], last["eval/batches"], last["eval/targets"]) == (1, 1, 12)
    results = {}
    for packing in (True, False):
        c = replace(cfg, data=replace(cfg.data, packing=packing))
        evaluator = Evaluator(build_recipe(c, trainer.groups), str(many), max_batches=None,
                              groups=step_groups(trainer.groups), rows_per_rank=2)  # fmt: skip
        results[packing] = evaluator.run(trainer.runner)
    packed, unpacked = results[True], results[False]
    want = _targets(SFT_PAIRS[1:])
    assert packed["eval/targets"] == unpacked["eval/targets"] == want
    assert packed["eval/rows"] < unpacked["eval/rows"] == 8  # packing did pack
    loss = unpacked["eval/loss"]
    numerics.assert_close(packed["eval/loss"], loss, n=want, scale=loss, what="packed eval/loss")


def test_is_due() -> None:
    assert [s for s in range(1, 8) if is_due(s, 3, 7)] == [3, 6, 7]
    assert [s for s in range(1, 8) if is_due(s, 0, 7)] == [7]


class _Counting:
    """Stands in for an `Evaluator`: counts its runs."""

    def __init__(self) -> None:
        self.runs: list[Any] = []

    def run(self, runner: Any) -> dict[str, float]:
        self.runs.append(runner)
        return {"eval/loss": float(len(self.runs))}


def test_an_evaluation_runs_when_it_is_due() -> None:
    """`run_if_due` (the trainer's question after each step): every `eval.every` steps and
    after `train.steps`, through the runner it is given; nothing without an evaluator."""
    cfg = build_config({"model": {"preset": "tiny"}, "train": {"steps": 7}})
    cfg = replace(cfg, eval=replace(cfg.eval, every=3))
    counting, runner = _Counting(), object()
    got = {s: run_if_due(counting, runner, s, cfg) for s in range(1, 8)}  # type: ignore[arg-type]
    assert {s: r for s, r in got.items() if r} == {
        3: {"eval/loss": 1.0}, 6: {"eval/loss": 2.0}, 7: {"eval/loss": 3.0},
    }  # fmt: skip
    assert counting.runs == [runner] * 3
    assert run_if_due(None, runner, 7, cfg) == {}  # type: ignore[arg-type]


def test_no_eval_set() -> None:
    cfg = build_config({"model": {"preset": "tiny"}, "train": {"steps": 1}})
    trainer = Trainer(cfg, stream=io.StringIO())
    assert trainer.evaluator is None
    assert training_evaluator(cfg, trainer.groups, trainer.recipe) is None
    with pytest.raises(ValueError, match="no eval set: set eval.path"):
        trainer.evaluate()


# -- one pass over a data source --------------------------------------------------------------


class _Rows:
    """A one-row data source of `n` rows; `lazy`: the epoch turns when the next row is asked
    for (like DPOData), else as the last row is taken (like PackedStream)."""

    def __init__(self, n: int, *, lazy: bool, nested: bool = False) -> None:
        self.n, self.lazy, self.nested = n, lazy, nested
        self.epoch = self.row = 0
        self.seen: list[tuple[int, int]] = []

    def next_step(self) -> list[Any]:
        if self.lazy and self.row == self.n:
            self.epoch, self.row = self.epoch + 1, 0
        self.seen.append((self.epoch, self.row))
        self.row += 1
        if not self.lazy and self.row == self.n:
            self.epoch, self.row = self.epoch + 1, 0
        return []

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "row": self.row}
        return {"stream": state} if self.nested else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = state["stream"] if self.nested else state
        self.epoch, self.row = state["epoch"], state["row"]


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_a_pass_is_every_row_once(lazy: bool, n: int) -> None:
    data = _Rows(n, lazy=lazy, nested=lazy)
    start = data.state_dict()
    assert pass_rows(data, start) == n
    assert pass_rows(data, start, limit=2) == min(2, n)
    data.load_state_dict(start)
    data.seen = []
    for _ in range(n):
        data.next_step()
    assert data.seen == [(0, r) for r in range(n)]


class _DealtRows(_Rows):
    """`_Rows` whose step is one batch naming its row: (epoch, row)."""

    def next_step(self) -> list[Any]:
        super().next_step()
        return [self.seen[-1]]


class _CountingRecipe:
    """A recipe whose one statistic counts the batches a rank evaluated."""

    stats = ("batches",)

    def __init__(self, n: int) -> None:
        self.n = n

    def data(self, path: str) -> _DealtRows:
        return _DealtRows(self.n, lazy=False)

    def prepare(self, micro: Any, runner: Any) -> None:
        pass

    def counted(self) -> bool:
        return True

    def loss(self, out: Any, mb: Any) -> tuple[None, list[float]]:
        return None, [1.0]

    def finish(self, sums: np.ndarray) -> dict[str, float]:
        return {"counted": float(sums[0])}


class _RecordingRunner:
    """A stage runner that records the batches each eval batch dealt this rank."""

    def __init__(self) -> None:
        self.stage = paddle.nn.Layer()
        self.dealt: list[list[Any]] = []

    def micro_batches(self, batches: list[Any]) -> list[Any]:
        self.dealt.append(list(batches))
        return list(batches)

    def forward_only(self, micro: list[Any], fn: Any) -> list[Any]:
        return [fn(None, mb) for mb in micro]


@pytest.mark.parametrize(
    ("rows", "dp", "per_rank", "max_batches"),
    [(10, 3, 2, None), (12, 2, 3, None), (9, 2, 4, 1), (7, 4, 2, None)],
)
def test_dp_ranks_eval_disjoint_rows_that_cover_each_batch(
    rows: int, dp: int, per_rank: int, max_batches: int | None
) -> None:
    """With dp > 1 and several rows per rank, eval batch b deals its rows in order: dp rank r
    takes rows [r·n, (r+1)·n) of the batch (n = grad_accum × micro_batch_size), so the ranks'
    rows are disjoint and together are the batch (the short last one too, where later ranks
    get fewer rows or none), and every rank runs the same number of eval batches."""
    want = min(rows, (max_batches or rows) * dp * per_rank)
    runners = []
    for rank in range(dp):
        evaluator = Evaluator(_CountingRecipe(rows), "eval.jsonl",  # type: ignore[arg-type]
                              max_batches=max_batches, groups=[], dp_rank=rank, dp_size=dp,
                              rows_per_rank=per_rank)  # fmt: skip
        runner = _RecordingRunner()
        metrics = evaluator.run(runner)  # type: ignore[arg-type]
        assert metrics["eval/rows"] == want
        assert metrics["eval/counted"] == sum(len(b) for b in runner.dealt)
        runners.append(runner)
    batches = -(-want // (dp * per_rank))
    assert all(len(r.dealt) == batches for r in runners)
    for b in range(batches):
        first = b * dp * per_rank
        batch = [(0, i) for i in range(first, min(first + dp * per_rank, want))]
        for rank, runner in enumerate(runners):
            assert runner.dealt[b] == batch[rank * per_rank : (rank + 1) * per_rank]
        dealt = [row for runner in runners for row in runner.dealt[b]]
        assert sorted(dealt) == batch and len(set(dealt)) == len(dealt)


def test_data_epoch_and_a_source_without_epochs() -> None:
    assert data_epoch({"stream": {"epoch": 3, "doc": 1}}) == 3
    assert data_epoch({"position": 5}) is None and data_epoch([1]) is None

    class NoEpoch(_Rows):
        def state_dict(self) -> dict[str, Any]:
            return {"row": self.row}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.row = state["row"]

    assert pass_rows(NoEpoch(4, lazy=True), {"row": 0}, limit=3) == 3

    from flashcp.evaluation.evaluator import Evaluator

    class Recipe:
        def data(self, path: str) -> Any:
            return NoEpoch(4, lazy=True)

    with pytest.raises(ValueError, match=r"reports no epoch to end a pass by: set "
                                         r"eval\.max_batches"):  # fmt: skip
        Evaluator(Recipe(), "x.jsonl", max_batches=None, groups=[])  # type: ignore[arg-type]


def test_a_pass_too_long(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashcp.evaluation.evaluator as evaluate

    monkeypatch.setattr(evaluate, "MAX_PASS_ROWS", 5)
    with pytest.raises(ValueError, match=r"more than 5 rows: set eval\.max_batches"):
        pass_rows(_Rows(9, lazy=False), {"epoch": 0, "row": 0})


def test_a_recipe_without_loss_or_metrics_says_so() -> None:
    """Evaluation runs the recipe's loss and `finish` (there are no eval-only hooks)."""
    from flashcp.recipes.base import Recipe

    recipe = Recipe(None, None)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="defines no loss"):
        recipe.loss(None, None)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="defines no metrics"):
        recipe.finish(np.zeros(1))


def test_format_eval() -> None:
    line = format_eval(
        4, {"eval/loss": 2.5, "eval/targets": 1200.0, "eval/batches": 3.0, "eval/time_s": 0.25}
    )
    assert line == "eval step 4 | loss 2.5000 | 3 batches, 1,200 targets | 0.250 s"
    dpo = format_eval(2, {"eval/loss": 0.6, "eval/rewards/accuracy": 0.75,
                          "eval/logps/chosen": -80.0, "eval/examples": 8.0,
                          "eval/targets": 300.0})  # fmt: skip
    assert "rewards/accuracy 0.7500" in dpo and "8 pairs" in dpo and "logps" not in dpo


# -- DPO ---------------------------------------------------------------------------------------


DPO_EVAL = merged(
    TINY_GLM,
    model={"max_seq_len": 128},
    train={"steps": 2, "lr": 3e-3, "warmup_steps": 1, "grad_accum": 2, "seed": 0},
    dpo={"beta": 0.1},
    lora={"rank": 4, "target_modules": [".*q_proj", ".*v_proj"]},
    checkpoint={"every": 0},
    run={"recipe": "dpo"},
)
"""DPO + LoRA, two steps of two micro-batches."""


@pytest.mark.equivalence
def test_dpo_eval_equals_dpo_terms_on_policy_and_reference(tmp_path: Path, fit: Fit) -> None:
    lines = DPO_FILE.read_text().splitlines()
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(lines[-9:]) + "\n")
    plain = tiny_config(tmp_path / "plain", base=DPO_EVAL)
    cfg = tiny_config(tmp_path / "eval", base=DPO_EVAL, eval={"path": str(pairs), "every": 1})
    fit(plain)
    trainer = fit(cfg).trainer
    assert _training(cfg) == _training(plain)  # eval changes nothing in training
    last = read_metrics(cfg.run.output_dir)[-1]
    assert last["eval/examples"] == 9
    data = DPOData(_eval_cfg(cfg))
    model = trainer.model
    model.eval()
    per, chosen_r, rejected_r, logps, tokens = [], [], [], [], 0
    policy: list[tuple[np.ndarray, np.ndarray]] = []
    with paddle.no_grad():
        for _ in range(int(last["eval/rows"])):
            for batch in data.next_step():
                pc, pr = answer_logps(model, batch, chunk_tokens=0)
                with disable_adapters(model):
                    rc, rr = answer_logps(model, batch, chunk_tokens=0)
                loss, cr, rj = dpo_terms(pc, pr, rc, rr, beta=0.1)
                per += loss.numpy().tolist()
                chosen_r += cr.numpy().tolist()
                rejected_r += rj.numpy().tolist()
                logps += (np.abs(pc.numpy()) + np.abs(pr.numpy())).tolist()
                policy.append((pc.numpy(), pr.numpy()))
                tokens += int((batch.labels != -100).sum())
    assert len(per) == 9
    c, r = np.asarray(chosen_r), np.asarray(rejected_r)
    want = {
        "eval/loss": float(np.mean(per)),
        "eval/rewards/chosen": float(c.mean()),
        "eval/rewards/rejected": float(r.mean()),
        "eval/rewards/margin": float((c - r).mean()),
        "eval/logps/chosen": float(np.mean(np.concatenate([p[0] for p in policy]))),
        "eval/logps/rejected": float(np.mean(np.concatenate([p[1] for p in policy]))),
    }
    n, scale = tokens / 9, 0.1 * float(np.mean(logps))  # the rule's basis for DPO values
    for key, value in want.items():
        numerics.assert_close(last[key], value, n=n, scale=scale, what=key)
    assert last["eval/rewards/accuracy"] == float(np.mean(c > r))
    assert last["eval/targets"] == tokens
    assert abs(last["eval/rewards/margin"]) > 1e-3  # the policy moved: a real comparison
