"""CP attention in one process (cp = 1): parity, the saved fa_version, and input errors.

Multi-process parity (2 and 4 ranks) is in tests/integration/test_cp_multiproc.py.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from flashcp import fa_dispatch, mask_families, masks
from flashcp.attention import allgather_kv as cp_attention
from flashcp.attention import registry
from flashcp.attention.allgather_kv import flashmask_attention_cp
from flashcp.cp.layout import Assignment, shard_assigned, unshard_assigned
from flashcp.distributed import WORLD, NamedGroup
from flashcp.fa_dispatch import FlashAttnUnavailableError
from flashcp.kernels.registry import get_backend
from helpers.maskcases import overshoot
from helpers.reference import compare_attention, dense_reference

B, S, HQ, HKV, D = 2, 32, 4, 2, 8


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = [(B, S, HQ, D), (B, S, HKV, D), (B, S, HKV, D), (B, S, HQ, D)]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _run(q, k, v, dout, idx, causal, **kwargs):
    tq, tk, tv = (paddle.to_tensor(x, stop_gradient=False) for x in (q, k, v))
    out, lse = flashmask_attention_cp(tq, tk, tv, idx, causal=causal, return_lse=True, **kwargs)
    out.backward(paddle.to_tensor(dout))
    return out.numpy(), lse.numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


@pytest.mark.equivalence
@pytest.mark.parametrize("mode", registry.names())
@pytest.mark.parametrize("family", ["causal", "causal_document", "share_question", "document"])
def test_single_rank_matches_dense(family: str, mode: str) -> None:
    q, k, v, dout = _inputs()
    mask = mask_families.FAMILIES[family](B, S, 1, 3)
    got = _run(q, k, v, dout, mask.indices, mask.causal, mode=mode)
    want = dense_reference(q, k, v, dout, mask.indices, causal=mask.causal)
    bad = [c.describe() for c in compare_attention(got, want) if not c.ok]  # bench.numerics
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("mode", registry.names())
def test_values_beyond_seq_equal_the_clipped_mask(mode: str) -> None:
    """Global thresholds >= S (upstream's "through the last row") give bit-identical results
    to the same mask with S: same rebased local mask, same kernel call."""
    q, k, v, dout = _inputs(1)
    for family in ("causal", "document", "qk_sparse"):
        mask = mask_families.FAMILIES[family](B, S, 1, 5)
        over = overshoot(mask.indices, S, seed=2)
        assert (over > S).any()
        got = _run(q, k, v, dout, over, mask.causal, mode=mode)
        want = _run(q, k, v, dout, mask.indices, mask.causal, mode=mode)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
            assert np.array_equal(a, b), f"{family}: {name} differs"


# ------------------------------------------------------- one version, forward and backward


class _Recorder:
    """A backend table that runs the CPU kernel but records which version each phase used."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, version: int, device: str):
        real = get_backend(version, device)
        calls = self.calls

        class Recording:
            name = f"recording-fa{version}"

            def forward(self, *args, **kwargs):
                calls.append(("forward", version))
                return real.forward(*args, **kwargs)

            def backward(self, *args, **kwargs):
                calls.append(("backward", version))
                return real.backward(*args, **kwargs)

        return Recording()


# requested, FA4 available, deterministic, head_dim, policy -> expected (None = raises)
VERSION_ROWS = [
    (2, False, False, 8, "error", 2),
    (3, False, False, 8, "error", 3),
    (3, False, True, 8, "error", 3),
    (3, False, True, 192, "error", 2),
    (4, True, True, 256, "error", 4),  # FA4 takes 256/256 (not 192/192: its kernel limits)
    (4, True, False, 192, "fallback", 3),
    (4, False, False, 8, "error", None),
    (4, False, False, 8, "fallback", 3),
    (4, False, True, 192, "fallback", 2),
    (4, False, True, 8, "fallback", 3),
]


@pytest.mark.parametrize(("req", "fa4", "det", "hd", "policy", "expected"), VERSION_ROWS)
def test_backward_uses_the_version_forward_saved(
    monkeypatch: pytest.MonkeyPatch, req, fa4, det, hd, policy, expected
) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(cp_attention, "get_backend", recorder)
    monkeypatch.setattr(fa_dispatch, "probe_fa4", lambda: (fa4, "test"))
    monkeypatch.setattr(fa_dispatch, "probe_fa3", lambda: (True, "test"))  # an FA3 card
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, str(req))
    monkeypatch.setenv(fa_dispatch.FLAG_DETERMINISTIC, "1" if det else "0")
    rng = np.random.default_rng(1)
    q = paddle.to_tensor(rng.standard_normal((1, 16, 2, hd)).astype("float32"), stop_gradient=False)
    k = paddle.to_tensor(rng.standard_normal((1, 16, 2, hd)).astype("float32"), stop_gradient=False)
    idx = masks.causal_mask(1, 16).indices
    if expected is None:
        with pytest.raises(FlashAttnUnavailableError):
            flashmask_attention_cp(q, k, k, idx, causal=True, fa4_unavailable=policy)
        assert recorder.calls == []  # refused before any kernel ran
        return
    out = flashmask_attention_cp(q, k, k, idx, causal=True, fa4_unavailable=policy)
    # Flags change between forward and backward: backward must not re-read them.
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "2" if req != 2 else "3")
    monkeypatch.setenv(fa_dispatch.FLAG_DETERMINISTIC, "0" if det else "1")
    out.sum().backward()
    assert recorder.calls == [("forward", expected), ("backward", expected)]


# ----------------------------------------------------------------------------- errors


def _tensors(seq: int = S):
    q, k, v, _ = _inputs()
    return (paddle.to_tensor(x[:, :seq]) for x in (q, k, v))


def test_dropout_and_seed_offset_not_supported() -> None:
    q, k, v = _tensors()
    idx = masks.causal_mask(B, S).indices
    with pytest.raises(NotImplementedError, match="dropout"):
        flashmask_attention_cp(q, k, v, idx, causal=True, dropout=0.1)
    with pytest.raises(NotImplementedError, match="fixed_seed_offset"):
        flashmask_attention_cp(q, k, v, idx, causal=True, fixed_seed_offset=paddle.zeros([2]))


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("no mask", "needs the global startend_row_indices"),
        ("local mask", "pass the GLOBAL mask"),
        ("bad mode", "cp mode 'ring'"),
        ("rank3 q", "rank 4"),
        ("gqa", "multiple of key/value heads"),
        ("seq mismatch", "share batch and"),
        ("head dim", "head_dim"),
        ("assignment world", "assignment is for 2 ranks"),
        ("indivisible", "data.seq_len"),
        ("mask dtype", "int32"),
    ],
)
def test_input_errors(case: str, match: str) -> None:
    q, k, v = _tensors()
    idx = masks.causal_mask(B, S).indices
    kwargs: dict = {"causal": True}
    if case == "no mask":
        idx = None
    elif case == "local mask":
        idx = masks.causal_mask(B, S // 2).indices
    elif case == "bad mode":
        kwargs["mode"] = "ring"
    elif case == "rank3 q":
        q = q[0]
    elif case == "gqa":
        q = q[:, :, :3]
    elif case == "seq mismatch":
        k = k[:, :-2]
    elif case == "head dim":
        k, v = k[..., :4], v[..., :4]
    elif case == "assignment world":
        kwargs["assignment"] = Assignment.dualchunk(2)
    elif case == "indivisible":
        q, k, v = _tensors(S - 2)
        idx = masks.causal_mask(B, S - 2).indices
        kwargs["assignment"] = Assignment.from_lists([[0, 1, 2, 3]])
    elif case == "mask dtype":
        idx = idx.astype(np.int64)
    with pytest.raises(ValueError, match=match):
        flashmask_attention_cp(q, k, v, idx, **kwargs)


def test_workload_balanced_needs_a_mask() -> None:
    with pytest.raises(ValueError, match="needs the global mask"):
        registry.make_assignment("workload_balanced", 2, None)
    assert registry.make_assignment("contiguous_allgather", 2).ranks == ((0,), (1,))


# ------------------------------------------------------- group=None means the world group


def test_group_none_is_a_single_rank_without_a_distributed_world() -> None:
    assert cp_attention.resolve_group(None) is None  # this process is not launched
    g = NamedGroup("cp", 0, -1, [0], pg=None, name="one")
    assert cp_attention.resolve_group(g) is g


def test_group_none_plans_over_the_world_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a world of 2 (faked here; real launches in test_cp_default_group.py), None plans
    for rank/world of the world group, and a local mask gets a message saying what None meant.
    """
    world = NamedGroup(WORLD, 1, 0, [0, 1], pg=None, name="_default_pg")
    monkeypatch.setattr(cp_attention, "world_group", lambda: world)
    q, k, _ = _tensors(S // 2)
    plan = cp_attention.plan_cp_attention(q, k, masks.causal_mask(B, S).indices, causal=True)
    assert (plan.group, plan.rank, plan.world) == (world, 1, 2)
    np.testing.assert_array_equal(plan.assignment.positions(S, 1), plan_positions(S, 1))
    with pytest.raises(ValueError, match=r"group=None means the world group \(2 ranks"):
        cp_attention.plan_cp_attention(q, k, masks.causal_mask(B, S // 2).indices, causal=True)
    explicit = NamedGroup("cp", 0, -1, [1], pg=None, name="one")
    with pytest.raises(ValueError, match=r"pass the GLOBAL mask on every rank$"):
        cp_attention.plan_cp_attention(
            q, k, masks.causal_mask(B, S).indices, causal=True, group=explicit
        )


def plan_positions(seq: int, rank: int) -> np.ndarray:
    """Dual-chunk positions of `rank` among 2 ranks: chunks rank and 3 - rank of 4."""
    c = seq // 4
    return np.concatenate(
        [np.arange(rank * c, (rank + 1) * c), np.arange((3 - rank) * c, (4 - rank) * c)]
    )


# ------------------------------- every config mask family: CP = 2 and 4 equal CP = 1, in-process

CONFIG_MASKS = {
    ("pretrain", "causal"): {},
    ("pretrain", "sliding_window"): {"mask": "sliding_window", "sliding_window": 7},
    ("sft", "global_window"): {"mask": "global_window", "sliding_window": 5, "global_tokens": 3},
    ("pretrain", "prefix_lm"): {"mask": "prefix_lm", "prefix_len": 12},
    ("sft", "prefix_lm"): {"mask": "prefix_lm"},
}
"""(recipe, attention.mask) → its `attention` section, sized so that windows, global tokens
and prefixes cross the chunk boundaries of S = 64 at cp 2 and 4."""


def _config_mask(recipe: str, attention: dict) -> masks.Mask:
    """The global mask of the first micro-batch the data pipeline builds for the config,
    checked to differ from plain causal documents as its family does (fewer visible pairs
    under a window, more under a prefix)."""
    from flashcp.data import TrainData
    from helpers.configs import tiny_config

    cfg = tiny_config(None, attention=attention, run={"recipe": recipe},
                      data={"seq_len": S * 2, "micro_batch_size": B})  # fmt: skip
    batch = TrainData(cfg).next_step()[0]
    seen = (~batch.mask.dense()).sum()
    causal = (~masks.causal_document_mask(batch.doc_lens, batch=B).dense()).sum()
    kind = attention.get("mask", "causal")
    assert {"causal": seen == causal, "prefix_lm": seen > causal}.get(kind, seen < causal)
    return batch.mask


def _simulated_cp(q, k, v, dout, mask: masks.Mask, world: int, mode: str, monkeypatch):
    """`flashmask_attention_cp` on every rank of a `world`-rank cp group, one rank after the
    other in this process: each rank plans (its layout, its rebased mask) and runs the real
    forward and backward; the all-gather returns the ranks' K/V shards in rank order and the
    reduce-scatter is summed over the ranks afterwards. Returns the global (out, lse, dq, dk,
    dv)."""
    idx, causal = mask.indices, mask.causal
    assignment = registry.make_assignment(mode, world, idx, causal=causal)
    shard = lambda x, r: shard_assigned(paddle.to_tensor(x), r, assignment, axis=1)  # noqa: E731
    kv = {name: [shard(x, r) for r in range(world)] for name, x in (("k", k), ("v", v))}
    sent: dict[int, list[list[np.ndarray]]] = {r: [] for r in range(world)}

    def all_gather(x, group, axis=1, **_):
        for parts in kv.values():
            if np.array_equal(x.numpy(), parts[group.rank].numpy()):
                return paddle.concat(parts, axis=axis)
        raise AssertionError("gathered a tensor that is no rank's K or V shard")

    def reduce_scatter(chunks, group, **_):
        sent[group.rank].append([c.numpy() for c in chunks])  # dK then dV
        return paddle.zeros_like(chunks[group.rank])

    monkeypatch.setattr(cp_attention, "all_gather_tensor", all_gather)
    monkeypatch.setattr(cp_attention, "reduce_scatter_chunks", reduce_scatter)
    outs, lses, dqs = [], [], []
    for r in range(world):
        group = NamedGroup("cp", r, 9, list(range(world)), pg=None)
        tq = shard(q, r)
        tq.stop_gradient = False
        tk, tv = (paddle.to_tensor(kv[n][r].numpy(), stop_gradient=False) for n in "kv")
        out, lse = flashmask_attention_cp(tq, tk, tv, idx, causal=causal, group=group,
                                          mode=mode, return_lse=True)  # fmt: skip
        out.backward(shard(dout, r))
        outs.append(out.numpy())
        lses.append(lse.numpy())
        dqs.append(tq.grad.numpy())
    whole = lambda parts, axis=1: unshard_assigned(parts, assignment, axis=axis)  # noqa: E731
    grads = [whole([sum(sent[s][i][r] for s in range(world)) for r in range(world)])
             for i in (0, 1)]  # fmt: skip
    return whole(outs), whole(lses, axis=2), whole(dqs), *grads


@pytest.mark.equivalence
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", registry.names())
@pytest.mark.parametrize("case", sorted(CONFIG_MASKS), ids="-".join)
def test_config_mask_families_under_cp_equal_cp1(
    case: tuple[str, str], mode: str, world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each mask `attention.mask` can pick, as the data pipeline builds it for packed
    documents: CP attention over `world` ranks (every layout) gives the CP = 1 result, both
    within the float32 rule of the float64 reference. The mask is global and each rank rebases
    it, so a window, global tokens or a prefix crossing a chunk boundary stays exact."""
    mask = _config_mask(case[0], CONFIG_MASKS[case])
    rng = np.random.default_rng(world)
    shapes = [(B, S * 2, HQ, D), (B, S * 2, HKV, D), (B, S * 2, HKV, D), (B, S * 2, HQ, D)]
    q, k, v, dout = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    want = dense_reference(q, k, v, dout, mask.indices, causal=mask.causal)
    one = _run(q, k, v, dout, mask.indices, mask.causal, mode=mode)
    many = _simulated_cp(q, k, v, dout, mask, world, mode, monkeypatch)
    for label, got in (("cp1 ", one), (f"cp{world} ", many)):
        bad = [c.describe() for c in compare_attention(got, want, label=label) if not c.ok]
        assert not bad, "\n".join(bad)


def test_simulated_cp_sees_a_wrong_rebase(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of the in-process CP runs: every rank rebasing the window mask as
    rank 0 would (a layout bug) is caught."""
    mask = _config_mask("pretrain", CONFIG_MASKS[("pretrain", "sliding_window")])
    real = cp_attention.rebase_mask
    as_rank0 = lambda idx, **kw: real(idx, **{**kw, "rank": 0})  # noqa: E731
    monkeypatch.setattr(cp_attention, "rebase_mask", as_rank0)
    rng = np.random.default_rng(0)
    shapes = [(B, S * 2, HQ, D), (B, S * 2, HKV, D), (B, S * 2, HKV, D), (B, S * 2, HQ, D)]
    q, k, v, dout = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    want = dense_reference(q, k, v, dout, mask.indices, causal=mask.causal)
    got = _simulated_cp(q, k, v, dout, mask, 2, registry.DEFAULT_MODE, monkeypatch)
    assert any(not c.ok for c in compare_attention(got, want))
