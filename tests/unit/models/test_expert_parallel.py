"""Expert parallelism's single-process pieces: the rank layout and its checks, the dispatch plan
and its bytes, the all-to-all's arguments (and its NCCL call, faked), stage-only expert
construction (bitwise the slices of the whole model), checkpoint slicing, HF loading of one ep
rank's experts, the merged export's expert-only shards, the config rules and the eval guard.

(The launched equivalence tests: `tests/integration/test_expert_parallel.py`.)
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import paddle
import pytest

from flashcp.checkpoint.experts import ExpertArrays, model_key
from flashcp.checkpoint.optimizer_state import ClassicSource, optimizer_key
from flashcp.config import build_config
from flashcp.distributed import (
    Exchange,
    ParallelDims,
    ParallelGroups,
    all_to_all,
    comm_stats,
    gather_rows,
    reset_comm_stats,
)
from flashcp.distributed.dims import kind_groups
from flashcp.distributed.groups import NamedGroup, _nccl_groups, ep_link_pairs
from flashcp.models import StageSpec, build_model, estimate_parameters, preset
from flashcp.models.expert_parallel import (
    DispatchPlan,
    ExpertSlice,
    attach_exchange,
    expert_parallel_rows,
    expert_range,
    expert_tensors,
    uniform_bytes_per_rank,
)
from flashcp.models.moe import MoE
from flashcp.models.moe_dispatch import build_dispatch, combine, permute, relayout
from flashcp.optim.trainable import RowSlice, Trainable
from flashcp.problems import ProblemsError
from flashcp.trainer import expert_rows
from helpers.fakegroups import FakeNewGroup, ep_groups

EXPERTS_OF = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _args(**kw):
    return preset("tiny_glm_moe", **{"num_layers": 3, **kw})


# -- the rank layout ----------------------------------------------------------------------


def test_ep_groups_are_carved_from_the_stage_dp_cp_ranks() -> None:
    dims = ParallelDims(dp=2, pp=1, cp=2, world_size=4, ep=2)
    assert dims.expert_groups_for("ep") == [[0, 1], [2, 3]]  # inside each cp group
    assert dims.expert_groups_for("edp") == [[0, 2], [1, 3]]  # same experts: sum grads here
    assert [dims.ep_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert "ep=2" in dims.describe()
    dims = ParallelDims(dp=1, pp=2, cp=2, world_size=4, ep=2)  # per pipeline stage
    assert dims.expert_groups_for("ep") == [[0, 1], [2, 3]]
    assert dims.expert_groups_for("edp") == [[0], [1], [2], [3]]
    dims = ParallelDims(dp=2, pp=1, cp=3, world_size=6, ep=2)  # spans dp ranks
    assert dims.expert_groups_for("ep") == [[0, 1], [2, 3], [4, 5]]
    assert dims.edp_group_ranks(3) == [1, 3, 5]
    dims = ParallelDims(dp=2, pp=2, cp=2, world_size=8, ep=4)
    assert dims.expert_groups_for("ep") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert dims.stage_ranks(1) == [2, 3, 6, 7] and dims.stage_index(6) == 2
    with pytest.raises(KeyError, match="use 'ep' or 'edp'"):
        dims.expert_groups_for("dp")


def test_ep_degree_errors_name_the_keys() -> None:
    with pytest.raises(ValueError, match=r"parallel\.ep=3 does not divide dp×cp=4 .*one of "
                                         r"\[1, 2, 4\]"):  # fmt: skip
        ParallelDims(dp=2, pp=1, cp=2, world_size=4, ep=3)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=r"ep must be an integer >= 1.*parallel\.ep"):
            ParallelDims(dp=1, pp=1, cp=2, world_size=2, ep=bad)  # type: ignore[arg-type]


def test_groups_to_build_and_the_gloo_pair_links() -> None:
    dims = ParallelDims(dp=2, pp=1, cp=2, world_size=4, ep=4)
    assert kind_groups(dims, "ep") == [[0, 1, 2, 3]]
    assert kind_groups(dims, "edp") == []  # one rank per group: trivial
    assert kind_groups(ParallelDims(dp=1, pp=1, cp=2, world_size=2), "ep") == []
    assert ep_link_pairs(dims, "gloo") == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert ep_link_pairs(dims, "nccl") == []
    assert ep_link_pairs(ParallelDims(dp=2, pp=1, cp=2, world_size=4, ep=2), "gloo") == []


def test_nccl_path_creates_the_expert_groups_after_the_mesh() -> None:
    dims = ParallelDims(dp=2, pp=2, cp=2, world_size=8, ep=2)
    fake = FakeNewGroup()
    mine = _nccl_groups(dims, 5, 60, fake)
    mesh = dims.groups_for("dp") + dims.groups_for("pp") + dims.groups_for("cp")
    assert fake.calls == mesh + dims.expert_groups_for("ep") + dims.expert_groups_for("edp")
    assert mine["ep"].ranks == [4, 5] and mine["ep"].rank == 1
    assert mine["edp"].ranks == [1, 5] and mine["edp"].label == "edp[1,5]"


def test_parallel_groups_default_to_trivial_expert_groups() -> None:
    solo = NamedGroup("cp", 0, -1, [0], pg=None)
    groups = ParallelGroups(ParallelDims(1, 1, 1, 1), 0, solo, solo, solo, solo, "none")
    assert groups["ep"].is_trivial and groups["edp"].is_trivial
    assert groups.ep_exchange().nranks == 1 and "ep" not in groups.describe()


# -- the all-to-all's arguments ------------------------------------------------------------


def test_one_rank_exchange_and_argument_checks() -> None:
    solo = Exchange(NamedGroup("ep", 0, -1, [0], pg=None))
    x = paddle.arange(6, dtype="float32").reshape([3, 2])
    np.testing.assert_array_equal(all_to_all(x, [3], [3], solo).numpy(), x.numpy())
    assert gather_rows(x, solo) is x
    assert copy.deepcopy(solo) is solo and solo.link(7) is solo.group
    pair = Exchange(NamedGroup("ep", 0, 5, [0, 1], pg=None), {1: "link"})
    assert pair.link(1) == "link" and pair.label == "ep[0,1]"
    with pytest.raises(ValueError, match="one send and one receive count per rank, got 1"):
        all_to_all(x, [3], [3, 0], pair)
    with pytest.raises(ValueError, match="negative counts"):
        all_to_all(x, [4, -1], [0, 0], pair)
    with pytest.raises(ValueError, match=r"add up to 2 rows but x has 3"):
        all_to_all(x, [1, 1], [0, 0], pair)
    with pytest.raises(ValueError, match="root 2 is outside the 2 ranks"):
        gather_rows(x, pair, root=2)


def test_nccl_all_to_all_hands_both_split_lists_to_paddle(monkeypatch: pytest.MonkeyPatch) -> None:
    group = NamedGroup("ep", 1, 5, [0, 1], pg=FakeNewGroup.PG())
    calls = []

    def alltoall_single(out, x, send, recv, group):  # type: ignore[no-untyped-def]
        calls.append((list(x.shape), send, recv, group.label))
        out.set_value(paddle.full(out.shape, 7.0))

    monkeypatch.setattr(paddle.distributed, "alltoall_single", alltoall_single)
    reset_comm_stats()
    out = all_to_all(paddle.ones([5, 4]), [2, 3], [4, 1], Exchange(group))
    assert calls == [([5, 4], [2, 3], [4, 1], "ep[0,1]")]
    assert list(out.shape) == [5, 4] and float(out.sum()) == 140.0
    stats = comm_stats("all_to_all", "ep[0,1]")  # rank 1: its own block stays
    assert (stats.sent, stats.received) == (2 * 16, 4 * 16)


# -- the dispatch plan ---------------------------------------------------------------------


def _simulate(counts: np.ndarray) -> None:
    """Every rank's expert-sorted rows, exchanged by the plan, computed expert-major."""
    ep, experts = counts.shape
    rows = {  # rank s's buffer: (source, expert, index) per row, experts in order
        s: [(s, e, i) for e in range(experts) for i in range(counts[s, e])] for s in range(ep)
    }
    plans = [DispatchPlan(counts, r) for r in range(ep)]
    for r, plan in enumerate(plans):
        received = []
        for s in range(ep):
            start = sum(plans[s].send_splits[:r])
            received += rows[s][start : start + plans[s].send_splits[r]]
        assert len(received) == sum(plan.recv_splits) == sum(plan.local_counts)
        assert all(e in expert_range(experts, ep, r) for _, e, _ in received)
        major = [None] * len(received)
        for i, row in enumerate(received):
            major[plan.expert_major[i]] = row
        # expert-major: each local expert's rows contiguous, from source 0, then 1, ...
        assert major == sorted(received, key=lambda t: (t[1], t[0], t[2]))
        per = [sum(1 for _, e, _ in received if e == x) for x in expert_range(experts, ep, r)]
        assert plan.local_counts == per


def test_dispatch_plan_splits_and_expert_major_order() -> None:
    counts = np.array([[3, 0, 2, 1], [1, 4, 0, 2]])
    plan = DispatchPlan(counts, 0)
    assert plan.send_splits == [3, 3] and plan.recv_splits == [3, 5]
    assert plan.local_counts == [4, 4] and plan.per_rank == 2
    assert plan.bytes_sent(8) == 24 and plan.bytes_received(8) == 40
    _simulate(counts)
    _simulate(np.random.default_rng(0).integers(0, 5, size=(3, 6)))
    _simulate(np.zeros((2, 4), dtype=np.int64))  # nothing routed anywhere
    with pytest.raises(ValueError, match="5 experts do not split over 2 ep ranks"):
        DispatchPlan(np.zeros((2, 5), np.int64), 0)
    with pytest.raises(ValueError, match="ep rank 2 is outside 0..1"):
        DispatchPlan(counts, 2)


def test_uniform_theory_and_expert_ranges() -> None:
    assert uniform_bytes_per_rank(1024, 8, 256, 2, 4) == 1024 * 8 * 256 * 2 * 3 / 4
    assert expert_range(128, 4, 3) == range(96, 128)
    with pytest.raises(ValueError, match=r"model\.num_experts=6 is not divisible by "
                                         r"parallel\.ep=4"):  # fmt: skip
        expert_range(6, 4, 0)
    with pytest.raises(ValueError, match="ep rank 2 is outside 0..1"):
        expert_range(4, 2, 2)


@pytest.mark.parametrize("capacity", [None, 5])
def test_one_rank_expert_parallel_path_equals_the_grouped_path(capacity: int | None) -> None:
    """`expert_parallel_rows` over a one-rank group (counts, exchange, local layout with an
    order, reverse exchange) gives the grouped path's outputs and gradients exactly, dropless
    or with a capacity that drops entries."""
    args = preset("tiny_glm_moe", num_experts=8, num_experts_per_tok=2)
    paddle.seed(0)
    moe = MoE(args)
    x = paddle.to_tensor(np.random.default_rng(1).standard_normal((30, 64)).astype("float32"))
    solo = Exchange(NamedGroup("ep", 0, -1, [0], pg=None))
    results = []
    for ep in (False, True):
        moe.experts.clear_gradients()
        xt = x.clone()
        xt.stop_gradient = False
        ids, weights = moe.gate(x)
        d = build_dispatch(ids, 8, capacity)
        assert (d.dropped > 0) == (capacity is not None)
        if ep:
            rows, plan = expert_parallel_rows(moe.experts, permute(xt, d), d.counts, solo)
            out = combine(rows, d, weights)
            assert plan.local_counts == d.counts
        else:
            layout = moe.experts.plan(d.counts, xt)
            laid = relayout(d, layout.row_index(), layout.rows)
            out = combine(moe.experts(permute(xt, laid), layout), laid, weights)
        out.sum().backward()
        results.append((out.numpy(), xt.grad.numpy(), moe.experts.down_proj.grad.numpy()))
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


# -- stage-only construction ---------------------------------------------------------------


def _weights(model: paddle.nn.Layer) -> dict[str, np.ndarray]:
    return {n: p.numpy() for n, p in model.named_parameters()}


def test_a_stage_builds_only_its_experts_bitwise_the_whole_models_slices() -> None:
    args = _args()
    whole = _weights(build_model(args, seed=3))
    held = expert_range(args.num_experts, 2, 1)
    spec = StageSpec(1, 2, range(2, 3), ep_rank=1, ep_size=2)
    stage = build_model(args, stage=spec, seed=3)
    mine = _weights(stage)
    for name, value in mine.items():
        want = whole[name]
        if name.endswith(EXPERTS_OF):
            want = want[held.start : held.stop]
        np.testing.assert_array_equal(value, want, err_msg=name)
    layer = stage.model.layers[2].mlp
    assert (layer.ep_rank, layer.ep_size, layer.experts.first_expert) == (1, 2, 2)
    assert sum(v.size for v in mine.values()) == estimate_parameters(
        args, layers=spec.layers, first=False, last=True, ep_size=2
    )
    assert expert_tensors(stage) == {
        f"model.layers.2.{n}": ExpertSlice(2, 2, 4) for n in EXPERTS_OF
    }
    assert expert_tensors(build_model(args, seed=3)) == {}  # every expert: nothing partial


def test_expert_parallel_misuse_is_refused() -> None:
    args = _args()
    with pytest.raises(ValueError, match="parallel.ep=2 splits the routed experts of a MoE "
                                         "model, but arch gpt"):  # fmt: skip
        build_model(preset("tiny"), stage=StageSpec(0, 1, range(2), 0, 2))
    with pytest.raises(ValueError, match="ep rank 2 is outside 0..1"):
        build_model(args, stage=StageSpec(0, 1, range(3), 2, 2))
    with pytest.raises(ValueError, match="not one ep rank's share"):
        MoE(args, experts=range(1, 3))
    stage = build_model(args, stage=StageSpec(0, 1, range(3), 0, 2), seed=0)
    x = paddle.zeros([1, 4], dtype="int64")
    from flashcp.attention.context import AttentionContext

    with pytest.raises(RuntimeError, match=r"holds experts 0..1 of 4 \(ep rank 0 of 2\) but has "
                                           r"no expert-parallel group"):  # fmt: skip
        stage(x, paddle.arange(4).reshape([1, 4]), AttentionContext(mask=None, causal=True))
    wrong = Exchange(NamedGroup("ep", 1, 5, [0, 1], pg=None))
    with pytest.raises(ValueError, match=r"holds the experts of ep rank 0 of 2, but the ep "
                                         r"group ep\[0,1\] has 2 ranks and this rank is "
                                         r"its 1"):  # fmt: skip
        attach_exchange(stage, wrong)
    right = Exchange(NamedGroup("ep", 0, 5, [0, 1], pg=None))
    assert attach_exchange(stage, right) == 2  # the two MoE layers
    assert copy.deepcopy(stage).model.layers[1].mlp.exchange is right  # shared, not copied


# -- checkpoints ----------------------------------------------------------------------------


def test_checkpoint_arrays_are_sliced_to_the_ranks_experts() -> None:
    args = _args()
    stage = build_model(args, stage=StageSpec(0, 1, range(3), 1, 2), seed=0)
    arrays = ExpertArrays(stage, ep_groups(1, ep=2))
    assert arrays.active and arrays.collector  # edp rank 0: the stage writer's ep group
    name = "model.layers.1.mlp.experts.down_proj"
    full = {name: np.arange(4 * 32 * 64, dtype=np.float32).reshape(4, 32, 64), "other": 1}
    got = arrays.slice(full)
    np.testing.assert_array_equal(got[name], full[name][2:4])
    assert got["other"] == 1
    # the optimizer's state is not sliced: it reads its rows of the whole saved moments by
    # element range (`Trainable.first_element`); beta powers are per tensor
    held = Trainable.of(stage, ep_groups(1, ep=2), expert_rows(stage))
    rows = dict(held.params)[name]
    pows = {f"{name}::beta{i}_pow_acc_0": np.ones(1) for i in (1, 2)}
    saved = ClassicSource({f"{name}::moment1_0": full[name], **pows})
    got = saved.read(name, "moment1", held.first_element(name), int(np.prod(rows.shape)))
    assert got is not None and list(rows.shape) == [2, 32, 64]
    np.testing.assert_array_equal(got, full[name][2:4].reshape(-1))
    assert [b.size for b in saved.beta_pows(name) or ()] == [1, 1]
    with pytest.raises(ValueError, match=r"has shape \[2, 32, 64\], expected 4 experts"):
        arrays.slice({name: full[name][:2]})
    assert held.full_numel(name) == full[name].size  # the whole tensor's, of this rank's rows
    # the optimizer learns the expert layout as data only: ep > 1 without it is refused
    assert held.experts == {f"model.layers.{i}.{n}": RowSlice(2, 2, 4)
                            for i in (1, 2) for n in EXPERTS_OF}  # fmt: skip
    with pytest.raises(ValueError, match=r"ep group has 2 ranks but the optimizer was not told"):
        Trainable.of(stage, ep_groups(1, ep=2))
    assert model_key(name) == name and optimizer_key(f"{name}::beta2_pow_acc_0") is None
    solo = ExpertArrays(build_model(args, seed=0), ep_groups(0, ep=1))
    assert not solo.active and solo.collect(lambda: {"a": np.ones(1)}) == {"a": np.ones(1)}


def test_hf_checkpoint_loads_one_ep_ranks_experts(tmp_path: Path) -> None:
    from flashcp.models.hf_load import load_hf_checkpoint
    from flashcp.models.hf_save import save_hf_checkpoint

    args = _args()
    whole = build_model(args, seed=5)
    save_hf_checkpoint(whole, tmp_path / "hf")
    stage = build_model(args, stage=StageSpec(0, 1, range(3), 1, 2), seed=9)
    report = load_hf_checkpoint(stage, tmp_path / "hf")
    weights = _weights(whole)
    for name, value in _weights(stage).items():
        want = weights[name][2:4] if name.endswith(EXPERTS_OF) else weights[name]
        np.testing.assert_array_equal(value, want, err_msg=name)
    others = {f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in (1, 2) for e in (0, 1)
              for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    assert set(report.foreign) == others  # the other ep rank's experts: neither read nor refused


def test_merged_export_of_a_later_ep_rank_holds_only_its_experts() -> None:
    from flashcp.checkpoint.merge_export import merged_specs

    stage = build_model(_args(), stage=StageSpec(0, 1, range(3), 1, 2), seed=0)
    keys = [spec.key for spec in merged_specs(stage, experts_only=True)]
    assert keys and all(".mlp.experts.2." in k or ".mlp.experts.3." in k for k in keys)
    assert len(keys) == 2 * 2 * 3  # layers × experts × (gate, up, down)
    assert len(merged_specs(stage)) > len(keys)


# -- config rules and the eval guard -------------------------------------------------------


def _config(**parallel):
    return {
        "model": {"preset": "tiny_glm_moe"},
        "parallel": {"cp": 2, **parallel},
        "data": {"seq_len": 64},
        "run": {"output_dir": "/tmp/x"},
    }


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (_config(ep=3), r"parallel\.ep=3 does not divide dp×cp=2"),
        (
            _config(dp=4, ep=8),
            r"model\.num_experts=4 % parallel\.ep=8 = 4: .*set parallel\.ep=4, "
            r"or set parallel\.ep=2, or set parallel\.ep=1",
        ),
        ({**_config(ep=2), "model": {"preset": "tiny"}}, r"model\.arch is gpt \(no experts\)"),
        (_config(ep=0), r"parallel\.ep: must be an integer >= 1"),
    ],
)
def test_config_rules_name_the_keys(raw: dict, message: str) -> None:
    with pytest.raises(ProblemsError, match=message):
        build_config(raw)


def test_a_valid_ep_config() -> None:
    cfg = build_config(_config(dp=2, ep=4))
    assert cfg.parallel.ep == 4 and cfg.parallel.world_size == 4


def test_eval_refuses_a_short_last_batch_when_ep_spans_dp() -> None:
    from flashcp.evaluation.evaluator import Evaluator, ep_lockstep

    assert ep_lockstep(1, 3) is None and ep_lockstep(2, 4) is None
    assert "parallel.ep=4 with parallel.cp=2" in str(ep_lockstep(4, 2))
    assert ep_lockstep(2, 3) is not None  # cp = 3: the group {2, 3} holds dp 0 and dp 1

    class Rows:
        def __init__(self) -> None:
            self.row = 0

        def state_dict(self) -> dict:
            return {"epoch": self.row // 5, "row": self.row}

        def load_state_dict(self, state: dict) -> None:
            self.row = state["row"]

        def next_step(self) -> list:
            self.row += 1
            return [self.row]

    class Recipe:
        def data(self, path: str) -> Rows:
            return Rows()

    kw = dict(max_batches=None, groups=[], dp_size=2, rows_per_rank=1)
    assert Evaluator(Recipe(), "e.jsonl", **kw).batches == 3  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"5 eval rows leave the last eval batch short .* set "
                                         r"eval\.max_batches to at most 2"):  # fmt: skip
        Evaluator(Recipe(), "e.jsonl", lockstep="ep spans dp", **kw)  # type: ignore[arg-type]
