"""Multi-token prediction (`flashcp.models.mtp`, `model.mtp_layers`, `model.mtp_loss_weight`):
the targets against a loop written from their definition, the shared head's logits and the
depth's log-probs against their float64 definition, the parameter names the checkpoints use,
the planner's count against the built model, the validation errors, recompute (bitwise) and
loss chunks (the float32 rule) on the MTP gradients, and what λ = 0 freezes — trainer runs of
two steps, with and without LoRA adapters on the MTP block.
(The forward against transformers' modules: `tests/hf/test_mtp_reference.py`; the parallel
layouts: `tests/integration/test_mtp_multiproc.py`.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import paddle
import pytest

from bench import numerics
from flashcp.attention.context import AttentionContext
from flashcp.config import collect
from flashcp.masks import causal_document_mask
from flashcp.models import StageSpec, build_model, estimate_parameters, preset
from flashcp.models.config import ModelArgs
from flashcp.models.head import IGNORE_INDEX
from flashcp.models.mtp import MTP_PARTS, is_mtp_layer, mtp_targets
from flashcp.optim.grads import trainable
from flashcp.problems import ProblemsError
from helpers.configs import TinyCfg, tiny_config
from helpers.trainruns import Fit, load_grads

MTP_NAMES = (
    "embed_tokens.weight",
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
)


# ----------------------------------------------------------------------- targets


def _loop_targets(ids: list[int], labels: list[int], docs: list[int], depth: int) -> tuple:
    """The definition, one position at a time: depth d at i takes token i+d and predicts
    token i+d+1 (the main label at i+d) when i and i+d lie in one document, else nothing;
    past the row's end token 0 and no target."""
    owner = [k for k, n in enumerate(docs) for _ in range(n)]
    got_ids, got_targets = [], []
    for i in range(len(ids)):
        j = i + depth
        inside = j < len(ids)
        got_ids.append(ids[j] if inside else 0)
        same = inside and owner[i] == owner[j]
        got_targets.append(labels[j] if same else IGNORE_INDEX)
    return got_ids, got_targets


def _packed(docs: list[int], prompts: list[int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One packed row: random tokens; SFT labels = the next token inside a document, none at
    a document's end nor for the first `prompts[k]` tokens of document k (its prompt)."""
    ids = np.random.default_rng(seed).integers(3, 250, sum(docs))
    labels = np.full_like(ids, IGNORE_INDEX)
    start = 0
    for n, p in zip(docs, prompts, strict=True):
        for i in range(start, start + n - 1):
            if i - start + 1 >= p:  # the token predicted (i+1) is a response token
                labels[i] = ids[i + 1]
        start += n
    return ids, labels


@pytest.mark.parametrize("depths", [1, 2, 3])
def test_mtp_targets_follow_the_definition(depths: int) -> None:
    rows = [([9, 1, 2, 12], [3, 0, 1, 5]), ([24], [0]), ([20, 4], [20, 2])]  # a prompt-only doc
    ids = np.stack([_packed(d, p, seed)[0] for seed, (d, p) in enumerate(rows)])
    labels = np.stack([_packed(d, p, seed)[1] for seed, (d, p) in enumerate(rows)])
    got_ids, got_targets = mtp_targets(ids, labels, [d for d, _ in rows], depths)
    assert got_ids.shape == got_targets.shape == (depths, 3, 24)
    assert got_ids.dtype == got_targets.dtype == np.int64
    for d in range(1, depths + 1):
        for b, (docs, _) in enumerate(rows):
            want_ids, want_targets = _loop_targets(list(ids[b]), list(labels[b]), docs, d)
            assert got_ids[d - 1, b].tolist() == want_ids
            assert got_targets[d - 1, b].tolist() == want_targets
    # never across a document's end, never a prompt token, nothing past the row's end
    assert (got_targets[:, 2, :20] == IGNORE_INDEX).all()  # the prompt-only document
    assert (got_targets[:, :, -1] == IGNORE_INDEX).all()
    assert (got_targets[0, 0, [8, 9, 10, 11]] == IGNORE_INDEX).all()  # ends of docs 1, 2, 3
    # each depth has d targets per document fewer than the main labels (no prompts: row 1)
    assert [(got_targets[d, 1] != IGNORE_INDEX).sum() for d in range(depths)] == [
        23 - d for d in range(1, depths + 1)
    ]


def test_mtp_targets_refuse_document_lengths_that_miss_the_row() -> None:
    ids = np.zeros((1, 10), dtype=np.int64)
    with pytest.raises(ValueError, match=r"document lengths \[4, 5\] sum to 9, not .* 10"):
        mtp_targets(ids, ids, [[4, 5]], 1)


# ----------------------------------------------------------------------- the built model


def _args(**overrides: object) -> ModelArgs:
    return preset("tiny_glm_moe", **{"mtp_layers": 1, **overrides})


def test_mtp_layers_carry_the_checkpoint_names_on_the_last_stage() -> None:
    args = _args(mtp_layers=2)
    model = build_model(args, seed=0)
    names = {n for n, _ in model.named_parameters()}
    layers = args.num_layers
    for d in range(2):
        mine = {n for n in names if n.startswith(f"model.layers.{layers + d}.")}
        parts = {n.removeprefix(f"model.layers.{layers + d}.") for n in mine}
        block = {
            n.removeprefix(f"model.layers.{layers - 1}.")
            for n in names
            if n.startswith(f"model.layers.{layers - 1}.")
        }
        assert parts == block | set(MTP_NAMES)  # a MoE decoder block plus the MTP parts
    assert len(model.decoder_layers()) == layers
    assert [is_mtp_layer(x) for x in model.mtp_layers()] == [True, True]
    assert not any(is_mtp_layer(x) for x in model.decoder_layers())
    assert len(model.attention_layers()) == layers
    assert set(MTP_PARTS) == {n.split(".")[0] for n in MTP_NAMES}
    # pipeline: only the last stage builds them
    first = build_model(args, stage=StageSpec(0, 2, range(0, 1)), seed=0)
    last = build_model(args, stage=StageSpec(1, 2, range(1, 2)), seed=0)
    assert first.mtp_layers() == [] and len(last.mtp_layers()) == 2
    assert not any(n.startswith(f"model.layers.{layers}.") for n, _ in first.named_parameters())


@pytest.mark.parametrize("name", ["tiny", "tiny_glm", "tiny_glm_moe"])
@pytest.mark.parametrize("depths", [1, 2])
def test_estimate_parameters_counts_the_mtp_layers(name: str, depths: int) -> None:
    args = preset(name, mtp_layers=depths)
    built = sum(int(np.prod(p.shape)) for p in build_model(args, seed=0).parameters())
    assert built == estimate_parameters(args)
    assert built > estimate_parameters(dataclasses.replace(args, mtp_layers=0))
    for s, r in enumerate((range(0, 1), range(1, 2))):
        stage = build_model(args, stage=StageSpec(s, 2, r), seed=0)
        got = sum(int(np.prod(p.shape)) for p in stage.parameters())
        assert got == estimate_parameters(args, layers=r, first=s == 0, last=s == 1)


@pytest.mark.parametrize(
    ("overrides", "key", "text"),
    [
        ({"mtp_layers": -1}, "mtp_layers", "must be an integer >= 0"),
        ({"mtp_layers": 1.5}, "mtp_layers", "must be an integer >= 0"),
        ({"mtp_layers": 0, "mtp_loss_weight": 0.3}, "mtp_loss_weight", "model.mtp_layers is 0"),
        ({"mtp_loss_weight": -0.1}, "mtp_loss_weight", "finite number >= 0"),
        ({"mtp_loss_weight": float("nan")}, "mtp_loss_weight", "finite number >= 0"),
        ({"mtp_loss_weight": True}, "mtp_loss_weight", "must be a number"),
    ],
)
def test_bad_mtp_arguments_are_named(overrides: dict, key: str, text: str) -> None:
    args = dataclasses.replace(_args(), **overrides)
    errors = {e.key: e.problem for e in args.problems()}
    assert list(errors) == [f"model.{key}"] and text in errors[f"model.{key}"], errors
    with pytest.raises(ValueError, match=f"model.{key}"):
        build_model(args)


def test_learned_positions_refuse_mtp_layers() -> None:
    args = dataclasses.replace(preset("tiny", position="learned"), mtp_layers=1)
    errors = {e.key: e.problem for e in args.problems()}
    assert "model.position: rotary" in errors["model.mtp_layers"]


def test_config_loading_names_the_mtp_keys() -> None:
    base = {"model": {"preset": "tiny_glm"}, "data": {"seq_len": 64}}
    _, errors = collect({**base, "model": {"preset": "tiny_glm", "mtp_loss_weight": 0.5}})
    assert [e.key for e in errors] == ["model.mtp_loss_weight"]
    assert "model.mtp_layers is 0" in errors[0].message
    # dpo refuses a trained MTP layer, saying why and what to set
    dpo = {**base, "run": {"recipe": "dpo"}, "model": {**base["model"], "mtp_layers": 1}}
    with pytest.raises(ProblemsError) as bad:
        tiny_config(base={**dpo, "model": {**dpo["model"], "mtp_loss_weight": 0.3}})
    assert [e.key for e in bad.value.problems] == ["model.mtp_loss_weight"]
    assert "set model.mtp_loss_weight=0" in bad.value.problems[0].message
    assert tiny_config(base=dpo).model.mtp_layers == 1  # carried frozen: fine under dpo


# ----------------------------------------------------------------------- training


TRAIN = {"steps": 2, "warmup_steps": 0, "lr": 3e-3, "seed": 0}


def _run(tiny_cfg: TinyCfg, tmp: Path, weight: float, **sections: dict) -> TinyCfg:
    return tiny_cfg(
        tmp,
        model={"preset": "tiny_glm_moe", "mtp_layers": 1, "mtp_loss_weight": weight},
        data={"seq_len": 64, "micro_batch_size": 2},
        train=TRAIN,
        checkpoint={"every": 0},
        debug={"dump_grads": True},
        **sections,
    )


def _mtp(names: object) -> list[str]:
    return [n for n in names if str(n).startswith("model.layers.2.")]  # type: ignore[attr-defined]


@pytest.mark.parametrize("weight", [0.0, 0.3])
def test_weight_zero_freezes_the_mtp_layers_and_a_weight_trains_them(
    tiny_cfg: TinyCfg, fit: Fit, tmp_path: Path, weight: float
) -> None:
    cfg = _run(tiny_cfg, tmp_path, weight)
    before = {n: p.numpy().copy() for n, p in build_model(cfg.model, seed=0).named_parameters()}
    fitted = fit(cfg)
    model = fitted.trainer.model
    params = dict(model.named_parameters())
    mtp = _mtp(params)
    assert len(mtp) > len(MTP_NAMES)  # the block and the MTP parts
    grads = load_grads(Path(cfg.run.output_dir), 1)
    records = fitted.records
    if weight == 0:
        assert all(params[n].stop_gradient for n in mtp)
        assert _mtp(n for n, _ in trainable(model)) == []
        assert _mtp(grads) == []
        for n in mtp:  # never run, never stepped
            np.testing.assert_array_equal(params[n].numpy(), before[n], err_msg=n)
        assert "mtp_loss" not in records[0] and "lm_loss" not in records[0]
    else:
        assert _mtp(n for n, _ in trainable(model)) == mtp
        assert sorted(_mtp(grads)) == sorted(mtp)
        assert all(np.abs(grads[n]).max() > 0 for n in mtp)
        assert all(not np.array_equal(params[n].numpy(), before[n]) for n in mtp)
        assert all(r["mtp_loss"] > 0 and r["loss"] > r["lm_loss"] for r in records)


LORA = {"rank": 4, "target_modules": [".*q_proj", ".*v_proj", ".*eh_proj"]}
"""Adapters on every attention's q and v — the MTP block's too — and on the MTP `eh_proj`."""


@pytest.mark.parametrize("weight", [0.0, 0.3])
def test_lora_on_the_mtp_block_trains_only_with_a_weight(
    tiny_cfg: TinyCfg, fit: Fit, tmp_path: Path, weight: float
) -> None:
    cfg = _run(tiny_cfg, tmp_path, weight, run={"recipe": "sft"}, lora=LORA)
    model = fit(cfg).trainer.model
    adapters = [n for n, _ in model.named_parameters() if n.endswith(("lora_A", "lora_B"))]
    on_mtp = _mtp(adapters)
    assert len(on_mtp) == 6  # A and B of q_proj, v_proj, eh_proj
    assert len(adapters) == 6 + 2 * 2 * 2  # and of q_proj, v_proj in the two decoder layers
    names = {n for n, _ in trainable(model)}
    assert names <= set(adapters)  # LoRA: only adapters train
    run = Path(cfg.run.output_dir)
    if weight == 0:
        assert names == set(adapters) - set(on_mtp)
        assert not _mtp(load_grads(run, 1)) and not _mtp(load_grads(run, 2))
    else:
        assert names == set(adapters)
        step1, step2 = load_grads(run, 1), load_grads(run, 2)
        # B starts at zero, so A's first gradient is zero; from step 2 both move
        assert all(np.abs(step1[n]).max() > 0 for n in on_mtp if n.endswith("lora_B"))
        assert all(np.abs(step2[n]).max() > 0 for n in on_mtp)


@pytest.mark.parametrize("chunk", [0, 7])
def test_mtp_logits_follow_the_shared_heads_definition(chunk: int) -> None:
    """An MTP depth's logits are ``head(norm(out))`` (HF's `shared_head.norm`, an RMSNorm
    here, then `shared_head.head`) of the block output `run_mtp` gives, and its log-probs
    their log-softmax at the targets: both written here in float64 numpy, the norm's weight
    set away from one, so a head that skipped its norm (or its weight) is far off."""
    model = build_model(_args(mtp_layers=1), seed=0)
    (layer,) = model.mtp_layers()
    head, width = layer.shared_head, model.args.hidden_size
    weight = np.random.default_rng(3).uniform(0.5, 2.0, width).astype("float32")
    head.norm.weight.set_value(weight)
    docs = [[20, 12], [7, 25]]
    rows = [_packed(d, [0] * len(d), seed) for seed, d in enumerate(docs)]
    ids, labels = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    mtp_ids, targets = mtp_targets(ids, labels, docs, 1)
    pos = paddle.arange(32).reshape([1, 32]).tile([2, 1])
    attn = AttentionContext(mask=causal_document_mask(docs).indices, causal=True)
    with paddle.no_grad():
        hidden = model(paddle.to_tensor(ids), pos, attn)
        (out,) = model.model.run_mtp(hidden, paddle.to_tensor(mtp_ids), pos, attn)
        logits = head.logits(out).numpy()
        (logps,) = model.mtp_token_logprobs(hidden, paddle.to_tensor(mtp_ids),
                                            paddle.to_tensor(targets), pos, attn,
                                            chunk_tokens=chunk)  # fmt: skip
    h = out.astype("float32").numpy().astype(np.float64)
    normed = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + model.args.norm_eps) * weight
    w = head.head.weight.numpy().astype(np.float64)  # [H, V]
    want = normed @ w
    scale = float((np.abs(normed) @ np.abs(w)).max())  # Σ|terms| of the largest logit
    numerics.assert_close(logits, want, n=width, scale=scale, what="MTP logits")
    top = want.max(axis=-1, keepdims=True)
    lse = (top + np.log(np.exp(want - top).sum(axis=-1, keepdims=True)))[..., 0]
    target = targets[0]
    picked = np.take_along_axis(want, np.maximum(target, 0)[..., None], axis=-1)[..., 0]
    want_logps = np.where(target != IGNORE_INDEX, picked - lse, 0.0)
    assert (target != IGNORE_INDEX).sum() > 40
    scale += float(np.abs(lse).max())  # and the log-sum-exp subtracted from it
    numerics.assert_close(logps.numpy(), want_logps, n=width, scale=scale, what="MTP log-probs")


def _mtp_grads(recompute: str, chunk: int) -> dict[str, np.ndarray]:
    """Gradients of main + MTP log-likelihood (2 depths) on two packed rows, the model built
    with `recompute`, the heads run in chunks of `chunk` targets."""
    model = build_model(_args(mtp_layers=2, recompute=recompute), seed=0)
    docs = [[20, 12], [7, 25]]
    rows = [_packed(d, [0] * len(d), seed) for seed, d in enumerate(docs)]
    ids, labels = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    mtp_ids, targets = mtp_targets(ids, labels, docs, 2)
    pos = paddle.arange(32).reshape([1, 32]).tile([2, 1])
    attn = AttentionContext(mask=causal_document_mask(docs).indices, causal=True)
    hidden = model(paddle.to_tensor(ids), pos, attn)
    main = model.token_logprobs(hidden, paddle.to_tensor(labels), chunk_tokens=chunk).sum()
    logps = model.mtp_token_logprobs(
        hidden, paddle.to_tensor(mtp_ids), paddle.to_tensor(targets), pos, attn, chunk_tokens=chunk
    )
    (main + paddle.add_n([lp.sum() for lp in logps])).backward()
    return {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.equivalence
def test_recompute_and_loss_chunks_keep_the_mtp_gradients() -> None:
    """Recompute reruns the same operations (bitwise); loss chunks only reorder sums."""
    want = _mtp_grads("none", 0)
    mtp = [n for n in want if n.startswith(("model.layers.2.", "model.layers.3."))]
    assert {n.split(".")[2] for n in mtp} == {"2", "3"}  # both depths are in the loss
    for mode in ("full", "refined"):
        got = _mtp_grads(mode, 0)
        assert got.keys() == want.keys()
        assert all(np.array_equal(got[n], want[n]) for n in want), mode
    chunked = _mtp_grads("none", 7)
    for name in want:
        numerics.assert_close(chunked[name], want[name], n=64, norm="l2", what=name)
