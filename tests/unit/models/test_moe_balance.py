"""Router load balancing (`flashcp.models.moe_balance`, `flashcp.metrics.moe_stats`): the bias
update rule, the sequence-wise balance loss against DeepSeek-V3's formula (and split over cp
ranks), the update lowering the load of a skewed router in training (not without it), the bias
saved / resumed bitwise / exported in HF layout, the metrics, the plot and the config checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
from safetensors.numpy import load_file

from flashcp import cli
from flashcp.config import Config, build_config, check_config
from flashcp.metrics.moe_stats import moe_layers
from flashcp.metrics.writer import read_metrics
from flashcp.models import ModelArgs, build_model, preset
from flashcp.models import moe_balance as mb
from flashcp.models.hf_load import load_hf_checkpoint
from flashcp.models.hf_save import save_hf_checkpoint
from flashcp.models.moe import MoE
from flashcp.parallelize import default_model_factory
from flashcp.problems import ProblemsError
from helpers.configs import Sections, tiny_config
from helpers.hf_glm45 import hf_config_json, random_checkpoint, write_checkpoint
from helpers.trainruns import Fit, losses

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


# ------------------------------------------------------------------------------ the rules


def test_bias_step_is_rate_times_sign_of_mean_minus_load() -> None:
    load = np.array([10, 2, 6, 6])  # mean 6
    np.testing.assert_array_equal(mb.bias_step(load, 0.25), [-0.25, 0.25, 0.0, 0.0])
    bias = paddle.to_tensor([1.0, 1.0, 1.0, 1.0])
    mb.update_bias(bias, load, 0.5)
    np.testing.assert_array_equal(bias.numpy(), [0.5, 1.5, 1.0, 1.0])
    assert bias.dtype == paddle.float32


def _deepseek(scores: np.ndarray, ids: np.ndarray, coef: float) -> tuple[float, np.ndarray]:
    """DeepSeek-V3 eqs. 17-20 per row, mean over rows, and its gradient w.r.t. the affinities
    (f constant): d/ds_j Σ_i f_i s_i / S = f_j / S - Σ_i f_i s_i / S²."""
    rows, length, experts = scores.shape
    k = ids.shape[-1]
    loss, grad = 0.0, np.zeros_like(scores, dtype=np.float64)
    for b in range(rows):
        s = scores[b].astype(np.float64)
        f = np.bincount(ids[b].reshape(-1), minlength=experts) * experts / (k * length)
        total = s.sum(-1, keepdims=True)
        loss += coef * float((f * (s / total).mean(0)).sum()) / rows
        fs = (s * f).sum(-1, keepdims=True)
        grad[b] = coef / rows / length * (f / total - fs / total**2)
    return loss, grad


def _routing(rows: int = 3, length: int = 10, experts: int = 6, k: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    scores = 1 / (1 + np.exp(-rng.standard_normal((rows, length, experts))))
    ids = np.argsort(-scores, axis=-1)[..., :k]
    return scores.astype(np.float32), ids


def test_sequence_balance_loss_is_deepseek_v3s() -> None:
    scores, ids = _routing()
    s = paddle.to_tensor(scores, stop_gradient=False)
    loss = mb.sequence_balance_loss(s, paddle.to_tensor(ids), 0.3)
    loss.backward()
    want, grad = _deepseek(scores, ids, 0.3)
    assert abs(float(loss) - want) <= 1e-6 * want
    assert np.linalg.norm(s.grad.numpy() - grad) <= 1e-5 * np.linalg.norm(grad)
    with mb.loss_scale_context(0.25):  # the trainer's 1 / (micro-batches · dp)
        assert abs(float(mb.sequence_balance_loss(s, paddle.to_tensor(ids), 0.3)) - want / 4) < 1e-7
    assert mb.loss_scale() == 1.0
    # balanced routing: f = 1 for every expert, Σ_i P_i = 1, so L = α exactly
    even_ids = (np.arange(24) % 6).reshape(1, 12, 2)  # every expert chosen 4 times
    even = mb.sequence_balance_loss(paddle.full([1, 12, 6], 0.5), paddle.to_tensor(even_ids), 0.3)
    assert abs(float(even) - 0.3) < 1e-6


class _Group:
    nranks = 2


def test_sequence_statistics_span_the_cp_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row's tokens split over two cp ranks: each rank's part, computed with the group's
    summed statistics, adds up to the whole row's loss, and each rank's gradient is exactly
    its tokens' slice of the whole gradient (no backward communication needed)."""
    scores, ids = _routing(length=12, seed=1)
    halves = [(scores[:, :5], ids[:, :5]), (scores[:, 5:], ids[:, 5:])]  # unequal shards
    seen: list[paddle.Tensor] = []
    monkeypatch.setattr(mb, "all_reduce_tensor", lambda t, g: seen.append(t.clone()) or t)
    for s, i in halves:
        mb.sequence_balance_loss(paddle.to_tensor(s), paddle.to_tensor(i), 0.3, _Group())
    total = seen[0] + seen[1]
    monkeypatch.setattr(mb, "all_reduce_tensor", lambda t, g: total)
    parts, grads = [], []
    for s, i in halves:
        st = paddle.to_tensor(s, stop_gradient=False)
        loss = mb.sequence_balance_loss(st, paddle.to_tensor(i), 0.3, _Group())
        loss.backward()
        parts.append(float(loss))
        grads.append(st.grad.numpy())
    want, grad = _deepseek(scores, ids, 0.3)
    assert abs(sum(parts) - want) <= 1e-6 * want
    got = np.concatenate(grads, axis=1)
    assert np.linalg.norm(got - grad) <= 1e-5 * np.linalg.norm(grad)
    # negative control: without the all-reduce each rank would see half a sequence
    monkeypatch.setattr(mb, "all_reduce_tensor", lambda t, g: t)
    alone = sum(
        float(mb.sequence_balance_loss(paddle.to_tensor(s), paddle.to_tensor(i), 0.3, _Group()))
        for s, i in halves
    )
    assert abs(alone - want) > 1e-3 * want


def test_moe_adds_the_loss_gradient_not_the_output() -> None:
    args = preset("tiny_glm_moe", num_experts=6, num_experts_per_tok=2)
    x = paddle.to_tensor(np.random.default_rng(2).standard_normal((2, 8, 64)).astype("float32"))
    outs, grads = [], []
    for coef in (0.0, 0.5):
        paddle.seed(0)
        moe = MoE(preset("tiny_glm_moe", num_experts=6, num_experts_per_tok=2,
                         router_aux_loss_coef=coef))  # fmt: skip
        out = moe(x)
        out.sum().backward()
        outs.append(out.numpy())
        grads.append(moe.gate.weight.grad.numpy())
        stats = moe.take_stats()
        assert (stats.aux_loss > 0) == (coef > 0)
    np.testing.assert_array_equal(outs[0], outs[1])
    paddle.seed(0)
    ref = MoE(args)
    routing = ref.gate.route(x.reshape([-1, 64]))
    loss = mb.sequence_balance_loss(
        routing.scores.reshape([2, 8, 6]), routing.ids.reshape([2, 8, 2]), 0.5
    )
    loss.backward()
    want = ref.gate.weight.grad.numpy()
    got = grads[1] - grads[0]
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    assert abs(stats.aux_loss - float(loss)) <= 1e-6 * float(loss)


# ------------------------------------------------------------------------------ training


ROUTER: Sections = {
    "model": {"preset": "tiny_glm_moe", "num_experts": 8, "num_experts_per_tok": 2},
    "data": {"seq_len": 256, "micro_batch_size": 2},
    # a learning rate of ~0 keeps the router as initialised: only the bias moves
    "train": {"steps": 20, "lr": 1e-9, "min_lr": 0.0, "warmup_steps": 0, "seed": 0},
    "checkpoint": {"every": 0},
}


def _router_cfg(run: Path, **model: Any) -> Config:
    """`ROUTER` with `model` keys over its model, writing to `run` itself."""
    return tiny_config(base=ROUTER, model=model, run={"output_dir": str(run)})


def _skewed_factory(cfg: Any, stage: Any) -> paddle.nn.Layer:
    """The configured model with a router skewed toward experts 0 and 1 (wider spread of
    every expert's score, experts 0 and 1 three times wider again)."""
    model = default_model_factory(cfg, stage)
    with paddle.no_grad():
        for moe in moe_layers(model).values():
            w = moe.gate.weight
            w.set_value(w * 10.0)
            w[:, :2] = w[:, :2] * 3.0
    return model


def _ratios(run: Path) -> np.ndarray:
    return np.array([r["moe/max_over_mean_max"] for r in read_metrics(run)])


def test_bias_update_lowers_the_load_of_a_skewed_router(tmp_path: Path, fit: Fit) -> None:
    runs = {}
    for rate in (0.0, 0.01):
        run = tmp_path / f"rate{rate}"
        cfg = _router_cfg(run, router_bias_update_rate=rate)
        trainer = fit(cfg, model_factory=_skewed_factory).trainer
        runs[rate] = _ratios(run)
        bias = moe_layers(trainer.model)[1].gate.e_score_correction_bias.numpy()
        if rate:  # the overloaded experts were pushed down, the others up
            assert bias[:2].max() < 0 < bias[2:].max()
        else:
            np.testing.assert_array_equal(bias, np.zeros(8, np.float32))
    off, on = runs[0.0], runs[0.01]
    assert off[0] == on[0] > 1.7  # the same skewed start (biases still zero)
    # without the update the imbalance stays (the router does not learn at lr ~ 0) ...
    assert off[-8:].mean() > 0.9 * off[:3].mean()
    # ... with it the last steps are far better balanced than the start and than without
    assert on[-8:].mean() < 0.8 * on[:3].mean()
    assert on[-8:].mean() < 0.75 * off[-8:].mean()


def test_bias_is_saved_resumed_bitwise_and_exported(tmp_path: Path, fit: Fit) -> None:
    whole = tmp_path / "whole"
    base = dict(router_bias_update_rate=0.01)
    full = fit(_with(_router_cfg(whole, **base), steps=4, every=2),
               model_factory=_skewed_factory).trainer  # fmt: skip
    part = tmp_path / "part"
    first = fit(_with(_router_cfg(part, **base), steps=4, every=2, stop=2),
                model_factory=_skewed_factory).trainer  # fmt: skip
    saved = load_file(str(next((part / "checkpoints").glob("step_*2/model*.safetensors"))))
    np.testing.assert_array_equal(
        saved[BIAS], moe_layers(first.model)[1].gate.e_score_correction_bias.numpy()
    )
    assert np.abs(saved[BIAS]).max() > 0  # two updates happened
    second = fit(_with(_router_cfg(part, **base), steps=4, every=2),
                 model_factory=_skewed_factory).trainer  # fmt: skip
    assert losses(part) == losses(whole)
    want = moe_layers(full.model)[1].gate.e_score_correction_bias.numpy()
    got = moe_layers(second.model)[1].gate.e_score_correction_bias.numpy()
    np.testing.assert_array_equal(got, want)
    # HF layout: the key GLM-4.5 checkpoints use, loaded back exactly
    save_hf_checkpoint(second.model, tmp_path / "hf")
    np.testing.assert_array_equal(load_file(str(tmp_path / "hf" / "model.safetensors"))[BIAS], want)
    fresh = build_model(second.model.args, seed=3)
    load_hf_checkpoint(fresh, tmp_path / "hf")
    np.testing.assert_array_equal(fresh.state_dict()[BIAS].numpy(), want)


def _with(cfg: Any, *, steps: int, every: int, stop: int = 0) -> Any:
    from dataclasses import replace

    return replace(
        cfg,
        train=replace(cfg.train, steps=steps),
        checkpoint=replace(cfg.checkpoint, every=every),
        run=replace(cfg.run, stop_after_steps=stop),
    )


def test_metrics_aux_loss_drop_rate_and_plot(tmp_path: Path, fit: Fit) -> None:
    cfg = _router_cfg(tmp_path, router_aux_loss_coef=0.01, moe_capacity_factor=1.0)
    fit(_with(cfg, steps=3, every=0), model_factory=_skewed_factory)
    records = read_metrics(tmp_path)
    for r in records:
        assert r["moe/max_over_mean_max"] >= r["moe/max_over_mean_mean"] >= 1.0
        # the skewed router overflows experts 0 and 1 at capacity factor 1
        assert 0 < r["moe/drop_rate"] < 1
        # the balance loss of a skewed router exceeds its balanced value α (one MoE layer)
        assert r["moe/aux_loss"] > 0.01
    from flashcp.metrics.plot import plot_groups

    groups = plot_groups(records)  # the panels `flashcp plot` draws: the moe one included
    assert {"moe/max_over_mean_max", "moe/aux_loss", "moe/drop_rate"} <= set(groups["moe"])
    assert cli.main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "metrics.png").stat().st_size > 0


def test_config_refuses_bias_updates_under_lora_and_bad_values() -> None:
    raw = {
        "run": {"recipe": "sft"},
        "model": {"preset": "tiny_glm_moe", "router_bias_update_rate": 0.001},
        "lora": {"rank": 4, "alpha": 8, "target_modules": [".*q_proj"]},
    }
    with pytest.raises(ProblemsError, match=r"model.router_bias_update_rate: .*frozen"):
        build_config(raw)
    raw["model"]["router_bias_update_rate"] = 0.0
    assert check_config(build_config(raw)) == []
    for field in ("router_bias_update_rate", "router_aux_loss_coef", "moe_capacity_factor"):
        errs = preset("tiny_glm_moe").__class__(arch="glm_moe", **{field: -1.0}).problems()
        assert any(e.key == f"model.{field}" and ">= 0" in e.problem for e in errs)
        dense = preset("tiny_glm").__class__(arch="glm", **{field: 0.5}).problems()
        assert any(e.key == f"model.{field}" and "only used by MoE families" in e.problem
                   for e in dense)


def test_a_pipeline_stage_packs_and_updates_only_its_layers() -> None:
    """Stage 0 of 2 holds MoE layer 1 of layers 1, 2: its vector has layer 2's slot empty
    (another stage fills it in the all-reduce) and it moves only its own router's bias."""
    from flashcp.metrics.moe_stats import RouterStats
    from flashcp.pipeline.stage import build_stage

    args = preset("tiny_glm_moe", num_layers=3, router_bias_update_rate=0.5)
    stage = build_stage(args, 0, 2, seed=0)
    stats = RouterStats(stage, args)
    assert stats.layers == [1, 2] and sorted(stats.local) == [1]
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 64, (1, 8)).astype("int64"))
    pos = paddle.to_tensor(np.arange(8)[None].astype("int64"))
    from flashcp.attention.context import AttentionContext

    stage(ids, pos, AttentionContext(mask=None, causal=True)).sum().backward()
    vec = stats.local_vector()
    e = args.num_experts
    assert vec[:e].sum() == 8 * args.num_experts_per_tok and not vec[e : 2 * e].any()
    other = np.zeros_like(vec)
    other[e : 2 * e] = [5, 0, 0, 3]  # what stage 1 adds for layer 2
    stats.update_biases(vec + other)
    bias = stats.local[1].gate.e_score_correction_bias.numpy()
    np.testing.assert_array_equal(bias, mb.bias_step(vec[:e], 0.5))
    metrics = stats.metrics(vec + other)
    assert metrics["moe/max_over_mean_max"] == 2.5  # layer 2: 5 / mean 2


def test_trained_mtp_layers_route_and_update_frozen_ones_do_not() -> None:
    """A trained MTP layer's MoE (`model.layers.{L}`) is packed after the decoder layers and
    its router bias moves with the loads; a frozen one (never run, exported as loaded) is in
    neither the vector nor the update."""
    from flashcp.metrics.moe_stats import RouterStats
    from flashcp.models import build_model

    frozen = preset("tiny_glm_moe", mtp_layers=1, router_bias_update_rate=0.5)
    model = build_model(frozen, seed=0)
    n = frozen.num_layers
    assert n in RouterStats(model, frozen).local  # built, with a router ...
    assert n not in RouterStats(model, frozen).layers  # ... that is not counted
    trained = preset("tiny_glm_moe", mtp_layers=1, mtp_loss_weight=0.5, router_bias_update_rate=0.5)
    stats = RouterStats(model, trained)
    assert stats.layers == [*RouterStats(model, frozen).layers, n]
    e = trained.num_experts
    loads = np.zeros(stats.size)
    loads[-2 - e : -2] = [6, 0, 1, 1]  # the MTP layer's slot: the last before dropped, aux
    bias = stats.local[n].gate.e_score_correction_bias
    before = bias.numpy().copy()
    stats.update_biases(loads)
    np.testing.assert_array_equal(bias.numpy(), before + mb.bias_step(np.array([6, 0, 1, 1]), 0.5))


def test_a_glm45_directory_without_moe_layers_trains(tmp_path: Path, fit: Fit) -> None:
    """A GLM-4.5 directory whose `first_k_dense_replace` covers every layer has no MoE layer:
    it loads, trains and reports no router statistics (was, at step 1: "zero-size array to
    reduction operation maximum" in the router statistics, issue 31)."""
    from flashcp.metrics.moe_stats import RouterStats

    args = ModelArgs(
        arch="glm_moe", vocab_size=300, hidden_size=32, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, intermediate_size=48, max_seq_len=64, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=2,
        router_bias_update_rate=0.01,
    ).check()  # fmt: skip
    config = hf_config_json(args, eos_token_id=257, pad_token_id=258)
    base = write_checkpoint(tmp_path / "glm45", random_checkpoint(args), config=config)
    run: Sections = {
        "data": {"seq_len": 32, "tokenizer": "byte"}, "train": {"steps": 2, "warmup_steps": 0},
        "run": {"device": "cpu"},
    }  # fmt: skip
    cfg = tiny_config(tmp_path, base=run, model={"from_pretrained": str(base)})
    fitted = fit(cfg)
    assert fitted.trainer.router is not None and fitted.trainer.router.layers == []
    assert [r["step"] for r in fitted.records] == [1, 2]
    assert not any(k.startswith("moe/") for r in fitted.records for k in r)
    stats = RouterStats(fitted.trainer.model, cfg.model)
    assert stats.metrics(stats.local_vector()) == {}
    stats.update_biases(stats.local_vector())  # nothing to move
