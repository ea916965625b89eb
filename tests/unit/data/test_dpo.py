"""DPO data: tokenization, the packed share-question layout, the unpacked baseline, errors."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import numerics
from flashcp.data.dpo_packing import (
    IGNORE_INDEX,
    assign_rows,
    pack_dpo,
    pack_dpo_batches,
    unpack_dpo,
)
from flashcp.data.dpo_records import DPOExample, fit_example
from flashcp.mask_indices import to_dense
from flashcp.masks import causal_mask
from flashcp.models import build_model, preset
from flashcp.recipes.dpo_loss import answer_logps
from helpers.dpo import builtin_preferences, plain_dpo_examples

BOS, EOS, PAD = 256, 257, 258


class ByteTok:
    """A tiny stand-in tokenizer: UTF-8 bytes plus BOS/EOS/PAD."""

    bos_id = BOS
    eos_id = EOS
    pad_id = PAD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def ex(p: int, c: int, r: int, base: int = 0) -> DPOExample:
    """An example of the given lengths with distinct token values."""
    toks = list(range(base, base + p + c + r))
    return DPOExample(tuple(toks[:p]), tuple(toks[p : p + c]), tuple(toks[p + c :]))


# ---------------------------------------------------------------------------- reading


def test_default_set_reads_and_tokenizes() -> None:
    records = builtin_preferences()
    assert len(records) >= 50
    assert all(r["chosen"] != r["rejected"] for r in records)
    exs = plain_dpo_examples(records, ByteTok())
    first = exs[0]
    assert first.prompt[0] == BOS and first.chosen[-1] == EOS and first.rejected[-1] == EOS
    assert bytes(first.prompt[1:]).decode() == records[0]["prompt"]
    assert bytes(first.chosen[:-1]).decode() == records[0]["chosen"]


# ---------------------------------------------------------------------------- packed layout


def test_packed_layout_tokens_positions_labels() -> None:
    e = DPOExample((10, 11, 12, 13), (20, 21, EOS), (30, EOS))
    b = pack_dpo([e], 12, pad_id=PAD)
    assert b.input_ids[0].tolist() == [10, 11, 12, 13, 20, 21, 13, 30, PAD, PAD, PAD, PAD]
    # both answers continue from the prompt end (position 3 is the repeated prompt token)
    assert b.positions[0].tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 0, 1, 2, 3]
    ig = IGNORE_INDEX
    assert b.labels[0].tolist() == [ig, ig, ig, 20, 21, EOS, 30, EOS, ig, ig, ig, ig]
    assert b.spans.tolist() == [[[0, 3, 6], [0, 6, 8]]]
    assert b.response_indexs().tolist() == [[0, 3, 6, 8]]
    assert b.real[0].tolist() == [True] * 8 + [False] * 4
    assert b.num_real_tokens == e.packed_len == 8


def _dense_allowed(b, exs) -> np.ndarray:
    """Independent oracle: which key each query may attend to, from the example lengths."""
    rows, seq = b.shape
    out = np.zeros((rows, seq, seq), dtype=bool)
    for row in range(rows):
        seg = np.full(seq, -1)  # segment id per column, -1 padding
        is_prompt = np.zeros(seq, dtype=bool)
        ex_of = np.full(seq, -1)
        for n, i in enumerate(b.example_ids):
            (r, cs, _), _ = b.spans[n]
            if r != row:
                continue
            e = exs[i]
            bounds = np.cumsum([cs - (len(e.prompt) - 1), len(e.prompt) - 1, len(e.chosen)])
            parts = [(bounds[0], bounds[1]), (bounds[1], bounds[2])]
            parts.append((bounds[2], bounds[2] + len(e.rejected)))
            for k, (lo, hi) in enumerate(parts):
                ex_of[lo:hi], seg[lo:hi] = n, 3 * n + k
            is_prompt[parts[0][0] : parts[0][1]] = True
        for i in range(seq):
            for j in range(i + 1):
                if ex_of[i] == -1 or ex_of[j] == -1:
                    out[row, i, j] = ex_of[i] == ex_of[j] == -1  # padding sees padding
                elif ex_of[i] == ex_of[j]:
                    out[row, i, j] = seg[i] == seg[j] or bool(is_prompt[j])
    return out


def test_packed_mask_matches_independent_dense_construction() -> None:
    exs = [ex(3, 2, 4, 0), ex(5, 3, 1, 20), ex(2, 6, 2, 40), ex(4, 1, 1, 60), ex(2, 2, 2, 80)]
    b = pack_dpo(exs, 16, pad_id=PAD)
    assert b.shape[0] >= 2 and b.mask.causal
    allowed = ~to_dense(b.mask.indices, causal=True)[:, 0]
    np.testing.assert_array_equal(allowed, _dense_allowed(b, exs))
    for n in range(b.num_examples):
        (row, cs, ce), (_, rs, re_) = b.spans[n]
        a = allowed[row]
        assert not a[rs:re_, cs:ce].any(), "the rejected answer must never see the chosen one"
        p = len(exs[b.example_ids[n]].prompt) - 1
        assert a[cs:ce, cs - p : cs].all() and a[rs:re_, cs - p : cs].all(), "both see the prompt"
        others = np.ones(b.shape[1], dtype=bool)
        others[cs - p : re_] = False
        assert not a[cs - p : re_][:, others].any(), "examples never see each other"


def test_several_examples_per_row_first_fit() -> None:
    exs = [ex(4, 3, 3), ex(4, 6, 6), ex(2, 1, 1)]  # 9, 15, 3 tokens
    b = pack_dpo(exs, 16, pad_id=PAD)
    assert b.shape == (2, 16)
    assert b.spans[:, 0, 0].tolist() == [0, 0, 1]  # the third example fills row 0's tail
    assert b.example_ids.tolist() == [0, 2, 1]
    labelled = (b.labels != IGNORE_INDEX).sum()
    assert labelled == sum(len(e.chosen) + len(e.rejected) for e in exs)
    for n, i in enumerate(b.example_ids):
        for a in (0, 1):
            row, s, e = b.spans[n, a]
            assert b.labels[row, s:e].tolist() == list(exs[i].answers[a])
            assert b.positions[row, s:e].tolist() == list(
                range(len(exs[i].prompt) - 1, len(exs[i].prompt) - 1 + e - s)
            )


def test_packed_batches_pad_with_empty_rows() -> None:
    exs = [ex(4, 5, 5, 7 * i) for i in range(5)]  # 13 tokens each: one per row of 16
    batches = list(pack_dpo_batches(exs, 16, 2, pad_id=PAD))
    assert [bt.shape for bt in batches] == [(2, 16)] * 3
    last = batches[-1]
    assert last.num_examples == 1 and not last.real[1].any()
    assert (last.labels[1] == IGNORE_INDEX).all() and (last.input_ids[1] == PAD).all()
    assert np.concatenate([bt.example_ids for bt in batches]).tolist() == list(range(5))


# ---------------------------------------------------------------------------- unpacked


def test_unpacked_baseline_layout_and_buckets() -> None:
    exs = [ex(4, 3, 9), ex(3, 2, 2, 30)]
    batches = unpack_dpo(exs, [8, 16], pad_id=PAD)
    assert [bt.shape for bt in batches] == [(3, 8), (1, 16)]
    small = batches[0]
    # example 0 chosen: prompt + chosen[:-1] = 6 tokens, labels on the 3 chosen tokens
    assert small.input_ids[0, :6].tolist() == [0, 1, 2, 3, 4, 5]
    assert small.positions[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    assert small.labels[0].tolist() == [-100, -100, -100, 4, 5, 6, -100, -100]
    # example 0's rejected answer went to the 16 bucket: missing here (row -1)
    assert small.spans[0].tolist() == [[0, 3, 6], [-1, 0, 0]]
    allowed = ~to_dense(small.mask.indices, causal=True)[0, 0]
    assert allowed[5, :6].all() and not allowed[6, :6].any()  # the padding is its own document
    paired = unpack_dpo(exs, [8, 16], pad_id=PAD, paired=True)
    assert [bt.shape for bt in paired] == [(2, 8), (2, 16)]
    assert all((bt.spans[..., 0] >= 0).all() for bt in paired)
    with pytest.raises(ValueError, match="even with paired=True"):
        unpack_dpo(exs, [8, 16], pad_id=PAD, paired=True, rows_per_batch=3)


# ---------------------------------------------------------------------------- real model


def _answer_units(got, want, lengths, what: str = "answer log-prob sum") -> float:
    """The largest per-answer error in units of the rule (`bench.numerics`): each sum is a
    reduction over its answer's tokens, scale = its |log-prob sum| (one sign throughout)."""
    return max(
        numerics.compare(g, w, n=max(int(n), 1), what=what).units
        for g, w, n in zip(got, want, lengths, strict=True)
    )


def _unpacked_sums(model, exs, buckets):
    got: dict[tuple[int, int], float] = {}
    for bt in unpack_dpo(exs, buckets, pad_id=PAD):
        c, r = answer_logps(model, bt)
        for k, i in enumerate(bt.example_ids):
            for a, v in ((0, c), (1, r)):
                if bt.spans[k, a, 0] >= 0:
                    got[(int(i), a)] = float(v[k])
    return np.array([[got[(i, a)] for a in (0, 1)] for i in range(len(exs))])


@pytest.mark.equivalence
@pytest.mark.parametrize("name", ["tiny_glm", "tiny"])
def test_packed_logps_equal_unpacked(name: str) -> None:
    """Sum of answer log-probs on the packed sequence == on the two unpacked sequences."""
    paddle.seed(0)
    model = build_model(preset(name))
    model.eval()
    exs = plain_dpo_examples(builtin_preferences()[:5], ByteTok())
    packed = pack_dpo(exs, 160, pad_id=PAD)
    rows = packed.spans[:, 0, 0].tolist()
    assert packed.shape[0] >= 2 and len(set(rows)) < len(rows)  # several examples per row
    with paddle.no_grad():
        c, r = answer_logps(model, packed)
        expect = _unpacked_sums(model, exs, [48, 96, 128])
        order = packed.example_ids
        # the same answers in another packing: within the float32 rule
        lengths = packed.spans[:, :, 2] - packed.spans[:, :, 1]  # [N, 2] answer tokens
        assert _answer_units(c.numpy(), expect[order, 0], lengths[:, 0]) <= numerics.FACTOR
        assert _answer_units(r.numpy(), expect[order, 1], lengths[:, 1]) <= numerics.FACTOR
        # control: rejected positions continuing from the chosen end give different log-probs
        wrong = pack_dpo(exs, 160, pad_id=PAD)
        for n in range(wrong.num_examples):
            (row, _, ce), (_, rs, re_) = wrong.spans[n]
            wrong.positions[row, rs:re_] = np.arange(ce, ce + re_ - rs)
        _, r_wrong = answer_logps(model, wrong)
        # (a random-init model barely uses positions: measured 9x (tiny) to 34x (tiny_glm) the
        # allowance, while the packing itself stays below 0.3 of it)
        wide = 4 * numerics.FACTOR
        control = "negative control: rejected positions"
        assert _answer_units(r_wrong.numpy(), expect[order, 1], lengths[:, 1], control) > wide
        # control: a plain causal mask (rejected sees chosen, examples see each other) differs
        leaky = pack_dpo(exs, 160, pad_id=PAD)
        leaky.mask = causal_mask(*leaky.shape)
        _, r_leaky = answer_logps(model, leaky)
        control = "negative control: leaky mask"
        assert _answer_units(r_leaky.numpy(), expect[order, 1], lengths[:, 1], control) > wide


# ---------------------------------------------------------------------------- errors


def test_overflow_and_truncation() -> None:
    long = ex(6, 8, 5)  # packed: 5 + 8 + 5 = 18 tokens
    with pytest.raises(ValueError, match=r"example 1 needs 18 tokens .* only 16 fit.*truncate"):
        pack_dpo([ex(2, 2, 2), long], 16, pad_id=PAD)
    b = pack_dpo([long], 16, pad_id=PAD, truncation="truncate")
    (_, cs, ce), (_, rs, re_) = b.spans[0]
    assert (ce - cs, re_ - rs) == (6, 5) and b.num_real_tokens == 16  # the longer answer shrank
    cut = fit_example(ex(12, 4, 4), 8, max_prompt_len=4)
    assert cut.prompt == tuple(range(8, 12)) and cut.packed_len <= 8
    with pytest.raises(ValueError, match="prompt of 12 tokens leaves 0 of the 8-token budget"):
        fit_example(ex(12, 4, 4), 8)
    with pytest.raises(ValueError, match="need 3 rows of 16 tokens but max_rows is 2"):
        pack_dpo([ex(4, 5, 5, 10 * i) for i in range(3)], 16, pad_id=PAD, max_rows=2)
    with pytest.raises(ValueError, match="truncation must be one of"):
        pack_dpo([long], 16, pad_id=PAD, truncation="drop")
    with pytest.raises(ValueError, match="unpacked layout .* only 8 fit"):
        unpack_dpo([ex(4, 6, 2)], [8], pad_id=PAD)
    fitted = unpack_dpo([ex(4, 6, 2)], [8], pad_id=PAD, truncation="truncate")[0]
    assert fitted.shape == (2, 8) and fitted.spans[0, 0, 2] - fitted.spans[0, 0, 1] == 5


def _first_fit_by_scan(lengths: list[int], seq_len: int) -> list[list[int]]:
    """First-fit the obvious way: scan the open rows in order for room."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lengths):
        for r, room in enumerate(free):
            if n <= room:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(seq_len - n)
    return rows


@settings(max_examples=200, deadline=None)
@given(st.integers(3, 64).flatmap(
    lambda s: st.tuples(st.just(s), st.lists(st.integers(1, s), max_size=80))))  # fmt: skip
def test_assign_rows_is_first_fit(case: tuple[int, list[int]]) -> None:
    seq_len, lengths = case
    assert assign_rows(lengths, seq_len) == _first_fit_by_scan(lengths, seq_len)
