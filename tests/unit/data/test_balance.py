"""Work-balanced packing (`flashcp.data.balance`) and the work model (`flashcp.cp.work`).

The work model's pair counts against the dense mask oracle; the balancer's rows against the
first-fit stream they re-pack (the same tokens per window and per epoch, nothing dropped or
duplicated, rows exactly full, DPO pairs never split; a step ending exactly with its epoch
keeps its window); resume mid-window; layout invariance; the modelled imbalance on the
long-tail mix at the issue's sizes; the metrics (against per-dp-rank and per-micro-batch sums
written out here), the plot panel and `flashcp data-stats`.
"""

from __future__ import annotations

import io
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp import cli
from flashcp.config import build_config, config_changes, hashed_dict, load_config
from flashcp.cp.work import (
    WorkModel,
    causal_pairs,
    document_pairs,
    mask_pairs,
    matmul_parameters,
    share_question_pairs,
)
from flashcp.data import TrainData, dpo_stream, mixes
from flashcp.data.balance import (
    BalancedPlan,
    Row,
    StepLayout,
    balance_window,
    fill_rows,
    step_balance,
    window_items,
)
from flashcp.data.dpo_stream import DPOData, DPORows
from flashcp.data.packing import PackedStream, Piece
from flashcp.masks import (
    DOCUMENT_MASKS,
    DocumentMasking,
    causal_document_mask,
    share_question_mask,
    sliding_window_mask,
)
from flashcp.metrics.flops import flops_per_token
from flashcp.metrics.plot import plot_groups
from flashcp.metrics.writer import read_metrics
from flashcp.models import preset
from flashcp.trainer import Trainer
from helpers.configs import tiny_config


class _Lengths:
    """Documents known by their lengths alone: all the planners read."""

    def __init__(self, lengths: Any) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.lengths.size)


def _dense_pairs(mask: Any) -> np.ndarray:
    """Visible pairs per batch row from the dense oracle (mean over mask heads)."""
    return (~mask.dense()).sum(axis=(2, 3)).mean(axis=1)


def _tokens(rows: list[list[Piece]]) -> Counter[tuple[int, int]]:
    """(document, position) of every token of `rows`, with multiplicity."""
    return Counter((p.doc, p.start + t) for row in rows for p in row for t in range(p.length))


# -- the work model ---------------------------------------------------------------------------


def test_pairs_from_segments_equal_the_masks_own() -> None:
    docs = [[5, 1, 9, 17], [32]]
    mask = causal_document_mask(docs)
    want = [int(causal_pairs(d).sum()) for d in docs]
    assert mask_pairs(mask.indices, causal=True).tolist() == want
    assert _dense_pairs(mask).tolist() == want
    examples = [[(3, 2, 4), (1, 5, 2)], [(6, 1, 1)]]
    dpo = share_question_mask(examples, seq_len=24)
    want = [
        int(sum(share_question_pairs(*e) for e in row)) + int(causal_pairs(24 - np.sum(row)))
        for row in examples
    ]
    assert mask_pairs(dpo.indices, causal=True).tolist() == want
    assert _dense_pairs(dpo).tolist() == want
    window = sliding_window_mask(2, 20, [3, 7])  # two heads: the mean of their counts
    np.testing.assert_array_equal(mask_pairs(window.indices, causal=True), _dense_pairs(window))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_document_pairs_equal_the_masks_own(data: st.DataObject) -> None:
    """Every `attention.mask` kind: the pairs the balancer counts from segment lengths (and
    prefixes) are the visible pairs of the mask the data pipeline builds from them."""
    kind = data.draw(st.sampled_from(DOCUMENT_MASKS))
    lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    prefixes = [data.draw(st.integers(0, n)) for n in lens]
    window, g = data.draw(st.integers(1, 50)), data.draw(st.integers(1, 6))
    spec = DocumentMasking(kind, window if "window" in kind else None,
                           g if kind == "global_window" else 0)  # fmt: skip
    mask = spec.build([lens], [prefixes])
    want = int(document_pairs(spec, np.asarray(lens), np.asarray(prefixes)).sum())
    assert mask_pairs(mask.indices, causal=mask.causal).tolist() == [want]
    assert _dense_pairs(mask).tolist() == [want]


def test_flops_per_token_is_the_work_models() -> None:
    args = preset("glm4_9b")
    n, heads = matmul_parameters(args), 40 * 32 * 128
    model = WorkModel.for_model(args)
    assert (model.linear_per_token, model.attention_per_pair) == (6.0 * n, 12.0 * heads)
    assert flops_per_token(args, 4096) == 6.0 * n + 12.0 * heads * 4096
    lora_dpo = WorkModel.for_model(args, lora=True, reference=True)
    assert (lora_dpo.linear_per_token, lora_dpo.attention_per_pair) == (6.0 * n, 16.0 * heads)
    assert flops_per_token(args, 512, lora=True, reference=True) == lora_dpo.flops_per_token(512)
    assert float(model.flops(10, 55)) == 10 * 6.0 * n + 55 * 12.0 * heads


# -- the balancer -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 90), min_size=1, max_size=40),
    seq_len=st.integers(8, 40),
    rows=st.integers(1, 4),
    window=st.integers(1, 3),
)
def test_rows_hold_exactly_first_fits_tokens(
    lengths: list[int], seq_len: int, rows: int, window: int
) -> None:
    """Per window the balanced rows hold first-fit's very tokens: every row exactly full, no
    token dropped or repeated, a document longer than a row in pieces of at most a row."""
    first_fit = PackedStream(_Lengths(lengths), seq_len, seed=1)
    steps = [[first_fit.plan_next() for _ in range(rows)] for _ in range(window)]
    items = window_items([r for s in steps for r in s], seq_len)
    assert all(0 < p.length <= seq_len for p in items)
    costs = causal_pairs([p.length for p in items]).tolist()
    cut = lambda p: int(causal_pairs(p.length))  # noqa: E731
    got = fill_rows(items, costs, steps=window, rows_per_step=rows, row_len=seq_len, cost_of=cut)
    assert got is not None and len(got) == window * rows
    assert all(sum(p.length for p in row) == seq_len for row in got)
    assert _tokens(got) == _tokens([r for s in steps for r in s])
    again = fill_rows(items, costs, steps=window, rows_per_step=rows, row_len=seq_len,
                      cost_of=cut)  # fmt: skip
    assert again == got  # deterministic


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 120), min_size=2, max_size=30),
    seq_len=st.integers(16, 64),
    rows=st.integers(2, 4),
    window=st.integers(1, 4),
    seed=st.integers(0, 3),
)
def test_same_documents_per_epoch_and_exact_resume(
    lengths: list[int], seq_len: int, rows: int, window: int, seed: int
) -> None:
    """Over every finished window, and so at each epoch's end, the balanced plan has trained
    on exactly first-fit's tokens; only first-fit's own mixed step holds two epochs; a plan
    restored from any step's state continues exactly."""
    first_fit = PackedStream(_Lengths(lengths), seq_len, seed=seed)
    plan = BalancedPlan(PackedStream(_Lengths(lengths), seq_len, seed=seed), rows, window)
    epoch_tokens = int(sum(lengths))
    seen: Counter[tuple[int, int]] = Counter()
    want: Counter[tuple[int, int]] = Counter()
    states, steps = [], []
    for _ in range(3 * epoch_tokens // (rows * seq_len) + 2):
        if plan.step * rows == len(plan._rows):  # a window ends here
            assert seen == want
        states.append(json.loads(json.dumps(plan.state_dict())))
        step = plan.next_step()
        steps.append(step)
        assert len(step) == rows and all(sum(p.length for p in r) == seq_len for r in step)
        seen += _tokens(step)
        want += _tokens([first_fit.plan_next() for _ in range(rows)])
    for k in (1, len(steps) // 2, len(steps) - 1):
        again = BalancedPlan(PackedStream(_Lengths(lengths), seq_len, seed=seed), rows, window)
        again.load_state_dict(states[k])
        assert [again.next_step() for _ in range(len(steps) - k)] == steps[k:]


def test_a_step_ending_exactly_with_its_epoch_keeps_the_whole_window() -> None:
    """An epoch of exactly `window` steps of first-fit rows (96 tokens = 3 steps × 2 rows × 16):
    the last row of its last step ends exactly with the epoch, so that step is not first-fit's
    mixed step and the window is the whole epoch — each epoch's steps are
    `balance_window` of the epoch's three first-fit steps, not of two and then one (the cut
    window's last step would carry a max/mean of 1.49 instead of 1.03 here)."""
    lengths = [40, 3, 5, 20, 2, 7, 9, 10]
    seq_len, rows, window = 16, 2, 3
    first_fit = PackedStream(_Lengths(lengths), seq_len, seed=0)
    plan = BalancedPlan(PackedStream(_Lengths(lengths), seq_len, seed=0), rows, window)
    for epoch in range(2):
        steps = [[first_fit.plan_next() for _ in range(rows)] for _ in range(window)]
        assert first_fit.state_dict() == {"epoch": epoch + 1, "doc": 0, "offset": 0,
                                          "sequences": (epoch + 1) * window * rows}  # fmt: skip
        whole = balance_window(steps, seq_len)
        cut = balance_window(steps[:-1], seq_len) + balance_window(steps[-1:], seq_len)
        assert cut != whole  # the two plans differ: the comparison below can tell them apart
        got = [row for _ in range(window) for row in plan.next_step()]
        cut_short = " (planned as 2 + 1 steps)" if got == cut else ""
        assert got == whole, f"epoch {epoch}: not one window of its 3 steps{cut_short}"


def _mean_balance(
    next_rows: Any, steps: int, layout: StepLayout, model: WorkModel, seq_len: int
) -> dict[str, float]:
    """`step_balance` of `steps` LM steps from `next_rows()`, averaged over the steps."""
    got = []
    for _ in range(steps):
        rows = [Row((), int(causal_pairs([p.length for p in r]).sum())) for r in next_rows()]
        got.append(step_balance(rows, layout, model, seq_len))
    return {k: float(np.mean([g[k] for g in got])) for k in got[0]}


def _max_over_mean(work: dict[Any, float]) -> float:
    return max(work.values()) / (sum(work.values()) / len(work))


def test_balance_metrics_are_the_per_rank_and_per_micro_batch_work() -> None:
    """A hand-built step of dp 2 × grad_accum 2 × micro-batch 2, rows in hand-out order
    (micro-batch by micro-batch, rank by rank), FLOPs = attention pairs: rank 0 holds 120 and
    rank 1 40, so `dp_work_max_over_mean` reads 1.5; its micro-batches 90, 30, 20, 20 read
    2.25. Both against sums written out per (micro-batch, rank) here; summing over the wrong
    axis (the micro-batches: 110 and 50) would read 1.375."""
    layout = StepLayout(dp=2, grad_accum=2, micro_batch_size=2)
    given = {(0, 0): [60, 30], (0, 1): [10, 10], (1, 0): [20, 10], (1, 1): [5, 15]}
    """(micro-batch, dp rank) → the pairs of its two rows."""
    rows = [Row((), n) for micro in range(2) for rank in range(2) for n in given[micro, rank]]
    got = step_balance(rows, layout, WorkModel(0.0, 1.0), seq_len=16)
    per_rank = {r: float(sum(sum(given[m, r]) for m in range(2))) for r in range(2)}
    per_micro = {key: float(sum(pairs)) for key, pairs in given.items()}
    assert (_max_over_mean(per_rank), _max_over_mean(per_micro)) == (1.5, 2.25)
    assert got == {"balance/dp_work_max_over_mean": 1.5,
                   "balance/microbatch_work_max_over_mean": 2.25}  # fmt: skip


def test_long_tail_reaches_the_issue_targets() -> None:
    """GLM-4-9B widths, the long-tail mix, dp 8: first-fit's per-step work max/mean ~1.2 at
    32K and ~1.4 at 128K; balanced <= 1.05 (mean over steps), micro-batches likewise."""
    model = WorkModel.for_model(preset("glm4_9b"))
    dp_key, mb_key = "balance/dp_work_max_over_mean", "balance/microbatch_work_max_over_mean"
    docs = _Lengths(mixes.long_tail(60000))
    for seq_len, worst in ((32768, 1.15), (131072, 1.25)):
        for dp, accum in ((8, 1), (8, 4)):
            layout = StepLayout(dp, accum, 1)
            steps = 32 if accum == 1 else 16
            stream = PackedStream(docs, seq_len, seed=0)
            none = _mean_balance(
                lambda s=stream, n=layout.rows: [s.plan_next() for _ in range(n)],
                steps, layout, model, seq_len,
            )  # fmt: skip
            plan = BalancedPlan(PackedStream(docs, seq_len, seed=0), layout.rows, 16)
            work = _mean_balance(plan.next_step, steps, layout, model, seq_len)
            assert none[mb_key] > worst, (seq_len, dp, accum, none)
            assert work[dp_key] <= 1.05 and work[mb_key] <= 1.05, (seq_len, dp, accum, work)


def test_dpo_pairs_never_split_and_steps_balance() -> None:
    """Balanced DPO rows: whole examples, within the row length, the same examples per
    window as first-fit; lighter than first-fit's imbalance; resume exact."""
    seq_len, n = 4096, 3000
    prompt, chosen, rejected = mixes.dpo(n, seq_len)
    lengths = prompt + chosen + rejected
    pairs = share_question_pairs(prompt, chosen, rejected)
    first = DPORows(lengths, pairs, seq_len, rows_per_step=8, seed=2)
    plan = DPORows(lengths, pairs, seq_len, rows_per_step=8, seed=2, balance_window=4)
    assert first.state_dict().keys() == {"epoch", "row"}
    layout = StepLayout(4, 2, 1)
    model = WorkModel.for_model(preset("glm4_9b"), reference=True)
    seen: Counter[int] = Counter()
    want: Counter[int] = Counter()
    imb: dict[str, list[float]] = {"none": [], "work": []}
    states, steps = [], []
    for _ in range(24):
        if plan.window_step * 8 == len(plan._window):
            assert seen == want
        states.append(plan.state_dict())
        rows = plan.next_step()
        steps.append(rows)
        assert all(int(lengths[r].sum()) <= seq_len for r in rows)
        seen += Counter(i for r in rows for i in r)
        ff = first.next_step()
        want += Counter(i for r in ff for i in r)
        for name, rs, p in (("none", ff, first), ("work", rows, plan)):
            info = [p.row_info(r) for r in rs]
            imb[name].append(step_balance(info, layout, model, seq_len)[
                "balance/microbatch_work_max_over_mean"])  # fmt: skip
    assert np.mean(imb["work"]) < np.mean(imb["none"]) and np.mean(imb["work"]) <= 1.02
    again = DPORows(lengths, pairs, seq_len, rows_per_step=8, seed=2, balance_window=4)
    again.load_state_dict(states[9])
    assert [again.next_step() for _ in range(15)] == steps[9:]


def test_dpo_window_that_does_not_fit_keeps_first_fits_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the balanced fill cannot place every pair, the window's first-fit rows are used
    as they are, heaviest first."""
    monkeypatch.setattr(dpo_stream, "fill_rows", lambda *args, **kwargs: None)
    prompt, chosen, rejected = mixes.dpo(400, 2048)
    lengths, pairs = prompt + chosen + rejected, share_question_pairs(prompt, chosen, rejected)
    first = DPORows(lengths, pairs, 2048, rows_per_step=4, seed=1)
    plan = DPORows(lengths, pairs, 2048, rows_per_step=4, seed=1, balance_window=3)
    want = [first.next_step() for _ in range(3)]
    got = [plan.next_step() for _ in range(3)]
    rows = [r for step in want for r in step]
    assert [r for step in got for r in step] == sorted(rows, key=lambda r: -plan.row_info(r).pairs)


# -- through the data sources, the trainer and the CLI -----------------------------------------


def _corpus(tmp: Path, n: int = 120) -> Path:
    """A JSON Lines corpus whose document lengths follow the long-tail shape (scaled down)."""
    lengths = np.clip(mixes.long_tail(n, seed=4) // 12, 8, 900)
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
    path = tmp / "corpus.jsonl"
    tmp.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for m in lengths:
            text = " ".join(rng.choice(words, size=int(m) // 6 + 1))[: int(m)]
            f.write(json.dumps({"text": text}) + "\n")
    return path


def _cfg(tmp: Path, **sections: dict[str, Any]) -> Any:
    """The tiny LM on a long-tail corpus under `tmp`, balanced in windows of 4 steps."""
    base = {
        "model": {"preset": "tiny", "max_seq_len": 256},
        "data": {"path": str(_corpus(tmp)), "seq_len": 256, "micro_batch_size": 1,
                 "balance_window": 4},  # fmt: skip
        "train": {"steps": 5, "grad_accum": 2, "lr": 3e-3, "warmup_steps": 1, "seed": 0},
        "checkpoint": {"every": 0},
    }
    return tiny_config(tmp, base=base, **sections)


def test_layouts_of_one_step_size_train_on_the_same_rows(tmp_path: Path) -> None:
    """dp 2 × accum 2, dp 1 × micro-batch 4 and dp 4: the same rows, dealt the same way."""
    whole = TrainData(_cfg(tmp_path, data={"micro_batch_size": 4}, train={"grad_accum": 1}))
    halves = [TrainData(_cfg(tmp_path), dp_rank=r, dp_size=2) for r in range(2)]
    quarters = [TrainData(_cfg(tmp_path, train={"grad_accum": 1}), dp_rank=r, dp_size=4)
                for r in range(4)]  # fmt: skip
    assert whole.plan is not None
    for _ in range(6):
        (big,) = whole.next_step()
        halves_step = [h.next_step() for h in halves]
        by_half = [halves_step[r][k].input_ids[0] for k in range(2) for r in range(2)]
        by_quarter = [q.next_step()[0].input_ids[0] for q in quarters]
        np.testing.assert_array_equal(np.stack(by_half), big.input_ids)
        np.testing.assert_array_equal(np.stack(by_quarter), big.input_ids)
    assert whole.state_dict() == halves[0].state_dict() == quarters[3].state_dict()
    metrics = halves[1].balance_metrics()
    assert set(metrics) == {"balance/dp_work_max_over_mean",
                            "balance/microbatch_work_max_over_mean"}  # fmt: skip
    assert all(v >= 1.0 for v in metrics.values())


def test_loader_metrics_are_the_work_each_dp_rank_trained_on(tmp_path: Path) -> None:
    """`TrainData.balance_metrics` after a step of dp 2 × grad_accum 2 × micro-batch 2 (first-fit
    rows: uneven) equals max/mean of the work computed here from the micro-batches each dp
    rank's `TrainData` handed out (their segment lengths, the model's work coefficients), per
    rank and per micro-batch. (float64 sums of a few terms in another order: 1e-12.)"""
    cfg = _cfg(tmp_path, data={"micro_batch_size": 2, "balance": "none"})
    ranks = [TrainData(cfg, dp_rank=r, dp_size=2) for r in range(2)]
    work = ranks[0].work
    given = {}
    for r, data in enumerate(ranks):
        for k, batch in enumerate(data.next_step()):
            pairs = sum(int(causal_pairs(lens).sum()) for lens in batch.doc_lens)
            given[k, r] = float(work.flops(batch.input_ids.size, pairs))
    per_rank = {r: given[0, r] + given[1, r] for r in range(2)}
    want = {"balance/dp_work_max_over_mean": _max_over_mean(per_rank),
            "balance/microbatch_work_max_over_mean": _max_over_mean(given)}  # fmt: skip
    assert want["balance/dp_work_max_over_mean"] > 1.01  # uneven: a wrong grouping shows
    for data in ranks:  # every rank reports the whole step's balance
        got = data.balance_metrics()
        assert got.keys() == want.keys()
        for key in want:
            assert math.isclose(got[key], want[key], rel_tol=1e-12), (key, got[key], want[key])


MASKS = {
    "sliding_window": {"mask": "sliding_window", "sliding_window": 24},
    "global_window": {"mask": "global_window", "sliding_window": 24, "global_tokens": 4},
    "prefix_lm": {"mask": "prefix_lm", "prefix_len": 40},
}
"""`attention` sections of each non-causal mask, sized for the long-tail corpus's 256-token
rows (documents of 1-4,000 tokens, most much longer than the window)."""


@pytest.mark.parametrize("kind", sorted(MASKS))
def test_balanced_rows_are_weighed_by_their_masks_pairs(tmp_path: Path, kind: str) -> None:
    """Under each `attention.mask` the balancer and the `balance/...` metrics weigh a row by
    the pairs its built mask leaves visible (`mask_pairs`), not by causal documents' — the
    weights that would balance a causal run put a window run's long documents in the wrong
    rows (negative control)."""
    data = TrainData(_cfg(tmp_path, attention=MASKS[kind]))
    assert data.plan is not None and data.masking.kind == kind
    modelled, causal = [], []
    for _ in range(4):
        batches = data.next_step()
        rows = [data.row_info(r) for r in data._last]
        built = [n for b in batches for n in mask_pairs(b.mask.indices, causal=b.mask.causal)]
        assert [r.pairs for r in rows] == [int(n) for n in built]
        modelled += [r.pairs for r in rows]
        causal += [sum(int(causal_pairs(p.length)) for p in r) for r in data._last]
    assert causal != modelled  # the mask matters: a causal count differs


def test_prefix_lm_pretrain_trains_no_prefix_token(tmp_path: Path) -> None:
    """`attention.prefix_len` N: each document's first N tokens see each other both ways and
    no label points into them, so no row is trained to predict a token it sees."""
    cfg = _cfg(tmp_path, attention=MASKS["prefix_lm"], data={"balance": "none"})
    data = TrainData(cfg)
    prefixed = 0
    for _ in range(4):
        for batch, pieces in zip(data.next_step(), data._last, strict=True):
            visible = ~batch.mask.dense()[0, 0]
            for i in np.flatnonzero(batch.labels[0] >= 0):  # token i + 1 is the target of row i
                assert not visible[i, i + 1], i
            start = 0
            for piece in pieces:
                k = data.stream.piece_prefix(piece)
                whole = min(40, int(data.stream.lengths[piece.doc]) - 1)  # BOS in; 1 target
                assert k == max(0, min(whole - piece.start, piece.length))
                if k >= 2:  # the prefix's first row sees its last token, not the one after
                    prefixed += 1
                    assert visible[start, start + k - 1]
                    assert k == piece.length or not visible[start, start + k]
                start += piece.length
    assert prefixed  # some documents started in these rows


def test_trainer_reports_balance_and_resumes_exactly(tmp_path: Path) -> None:
    full = _cfg(tmp_path / "a")
    Trainer(full, stream=io.StringIO()).fit()
    records = read_metrics(full.run.output_dir)
    for r in records:
        assert r["balance/microbatch_work_max_over_mean"] >= 1.0
        assert r["balance/rank_time_max_over_mean"] == 1.0  # one rank
    assert "balance" in plot_groups(records)
    part = _cfg(tmp_path / "b", checkpoint={"every": 3}, run={"stop_after_steps": 3})
    Trainer(part, stream=io.StringIO()).fit()  # stops mid-window (window 4 steps)
    rest = _cfg(tmp_path / "b", checkpoint={"every": 3})
    Trainer(rest, stream=io.StringIO()).fit()
    assert [r["loss"] for r in read_metrics(rest.run.output_dir)] == [r["loss"] for r in records]


def test_checkpoints_from_before_data_balance_packed_first_fit(tmp_path: Path) -> None:
    """A checkpoint saved before `data.balance` existed lacks its keys and packed first-fit
    (`EARLIER_VALUES`): resuming it with `data.balance=none` is no config change, with the
    default (`work`) one, named; a balanced run's own checkpoint resumes balanced."""
    balanced = _cfg(tmp_path, data={"balance_window": 16})
    first_fit = _cfg(tmp_path, data={"balance": "none", "balance_window": 16})
    earlier = hashed_dict(first_fit)
    del earlier["data"]["balance"], earlier["data"]["balance_window"]
    assert config_changes(earlier, first_fit) == []
    assert config_changes(earlier, balanced) == ["data.balance"]
    assert config_changes(hashed_dict(balanced), balanced) == []
    assert config_changes(hashed_dict(balanced), first_fit) == ["data.balance"]


def test_first_fit_runs_keep_their_state_format(tmp_path: Path) -> None:
    """`data.balance: none`, or one row per step: the first-fit stream and its state, as
    before; a first-fit state resumes a balanced plan at a window start."""
    plain = TrainData(_cfg(tmp_path, data={"balance": "none"}))
    one_row = TrainData(_cfg(tmp_path, train={"grad_accum": 1}))
    assert plain.plan is None and one_row.plan is None
    plain.next_step()
    state = plain.state_dict()
    assert set(state) == {"stream"}
    balanced = TrainData(_cfg(tmp_path))
    balanced.load_state_dict(state)
    assert balanced.state_dict() == {"stream": state["stream"], "window_step": 0}
    balanced.next_step()
    assert balanced.state_dict()["window_step"] == 1


def test_dpo_data_reports_balance(tmp_path: Path) -> None:
    cfg = build_config({
        "model": {"preset": "tiny_glm"},
        "data": {"seq_len": 128, "micro_batch_size": 1},
        "train": {"grad_accum": 2},
        "run": {"recipe": "dpo", "output_dir": str(tmp_path / "run")},
    })  # fmt: skip
    data = DPOData(cfg)
    assert data.plan.window == cfg.data.balance_window
    batches = data.next_step()
    ids = [i for b in batches for i in b.example_ids.tolist()]
    assert sorted(ids) == sorted(i for r in data._last for i in r)
    assert data.balance_metrics()["balance/microbatch_work_max_over_mean"] >= 1.0


def test_data_stats_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    cfg = _cfg(tmp_path)
    path.write_text(
        "model: {preset: tiny, max_seq_len: 256}\n"
        f"data: {{path: {cfg.data.path}, seq_len: 256, balance_window: 4}}\n"
        "parallel: {dp: 2}\ntrain: {grad_accum: 2}\n"
    )
    reports = {}
    for balance in ("none", "work"):
        assert cli.main(["data-stats", str(path), "--steps", "4", "--json",
                         f"data.balance={balance}"]) == 0  # fmt: skip
        reports[balance] = json.loads(capsys.readouterr().out)
    for report in reports.values():
        assert [s["step"] for s in report["steps"]] == [1, 2, 3, 4]
        for s in report["steps"]:
            assert [r["dp_rank"] for r in s["ranks"]] == [0, 1]
            for rank in s["ranks"]:
                assert len(rank["micro_batches"]) == 2
                for mb in rank["micro_batches"]:
                    (row,) = mb["rows"]
                    assert sum(row) + mb["padding"][0] == 256
    key = "balance/microbatch_work_max_over_mean"
    none, work = (reports[b]["mean"][key] for b in ("none", "work"))
    assert work < none
    assert cli.main(["data-stats", str(path), "--steps", "1"]) == 0
    text = capsys.readouterr().out
    assert "dp rank 1 micro-batch 1" in text and "mean over 1 steps" in text
    # the recipe's own data: DPO rows of whole preference pairs (share-question segments)
    dpo = tmp_path / "dpo.yaml"
    dpo.write_text("model: {preset: tiny_glm}\ndata: {seq_len: 128}\nparallel: {dp: 2}\n"
                   "train: {grad_accum: 2}\nrun: {recipe: dpo}\n")  # fmt: skip
    assert cli.main(["data-stats", str(dpo), "--steps", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    examples = DPOData(load_config(dpo)).index.lengths.tolist()
    for s in report["steps"]:
        for rank in s["ranks"]:
            for mb in rank["micro_batches"]:
                (row,) = mb["rows"]
                assert sum(row) + mb["padding"][0] == 128
                assert all(n in examples for n in row)
