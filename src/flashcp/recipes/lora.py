"""LoRA adapters on a flashcp `CausalLM`, through PaddleFormers' `LoRAModel`.

    lora = apply_lora(model, rank=8, alpha=16, target_modules=[".*q_proj", ".*v_proj"])
    hidden = lora(input_ids, positions, attn)          # base + adapters; only adapters train
    logp = lora.token_logprobs(hidden, labels)         # the (chunked) head, see flashcp.models
    with disable_adapters(lora):
        ref_hidden = lora(input_ids, positions, attn)  # the frozen base model (DPO reference)
    save_adapters(lora, "out/adapters")                # PaddleFormers' own format
    lora2 = load_adapters(build_model(args), "out/adapters")
    merged = merge_adapters(lora)                      # a plain CausalLM with W + s·A·B

PaddleFormers' `LoRAModel` wraps any Paddle layer whose `.config` is a
`paddleformers.transformers.PretrainedConfig` (it reads `tensor_model_parallel_size`), so
`apply_lora` / `load_adapters` attach one to the flashcp model (`flashcp_config`), with TP = 1
and the model's `ModelArgs` recorded for the saved `config.json`. Target modules are regular
expressions matched with `re.fullmatch` against sublayer names (PaddleFormers' rule), e.g.
``model.layers.0.self_attn.q_proj``; every pattern must match at least one `nn.Linear`.

Adapter math (PaddleFormers `LoRALinear`, Paddle weights are `[in, out]`):
``y = x W + b + dropout(x) A B · alpha / rank`` with A `[in, rank]` (Kaiming-uniform) and
B `[rank, out]` (zeros), so a fresh adapter leaves the model's output unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import paddle
from paddle import nn

from flashcp.models.base import CausalLM

# PaddleFormers' file names inside an adapter directory (its `save_pretrained` layout).
LORA_CONFIG_FILE = "lora_config.json"
SAFE_INDEX_FILE = "peft_model.safetensors.index.json"
LEGACY_WEIGHTS_FILE = "lora_model_state.pdparams"


def _peft() -> tuple[Any, Any, Any]:
    """PaddleFormers' LoRA classes (imported lazily: the import takes a few seconds)."""
    from paddleformers.peft import LoRAConfig, LoRAModel
    from paddleformers.peft.lora.lora_layers import LoRALinear

    return LoRAConfig, LoRAModel, LoRALinear


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence PaddleFormers' and Paddle's per-parameter INFO logging during LoRA calls."""
    names = ["PaddleFormers"]
    loggers = [logging.getLogger(n) for n in names]
    try:
        from paddle.distributed.fleet.utils.log_util import logger as fleet_logger

        loggers.append(fleet_logger)
    except ImportError:  # pragma: no cover - every supported Paddle has it
        pass
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.level, logging.WARNING))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def flashcp_config(model: CausalLM) -> Any:
    """A PaddleFormers `PretrainedConfig` describing `model` (TP = 1), set as `model.config`.

    An existing `PretrainedConfig` is kept (its `tensor_model_parallel_size` must be 1: flashcp
    shards sequences, not weights). The model's `ModelArgs` go into `flashcp_model_args` so the
    `config.json` PaddleFormers writes next to the adapters says which model they belong to.
    """
    from paddleformers.transformers import PretrainedConfig

    existing = getattr(model, "config", None)
    if isinstance(existing, PretrainedConfig):
        tp = int(getattr(existing, "tensor_model_parallel_size", 1))
        if tp != 1:
            raise ValueError(
                f"model.config.tensor_model_parallel_size is {tp}: flashcp LoRA supports only "
                "tensor_model_parallel_size=1"
            )
        return existing
    if existing is not None:
        raise TypeError(
            f"model.config is a {type(existing).__name__}, not a PaddleFormers PretrainedConfig; "
            "remove it or set a PretrainedConfig before applying LoRA"
        )
    args = getattr(model, "args", None)
    config = PretrainedConfig(
        tensor_model_parallel_size=1,
        tie_word_embeddings=bool(getattr(args, "tie_embeddings", False)),
        architectures=[type(model).__name__],
        flashcp_model_args=dataclasses.asdict(args) if dataclasses.is_dataclass(args) else {},
    )
    model.config = config
    return config


def _linear_names(model: nn.Layer) -> list[str]:
    return [name for name, layer in model.named_sublayers() if isinstance(layer, nn.Linear)]


def _check_targets(model: nn.Layer, target_modules: Sequence[str]) -> list[str]:
    """Compile each pattern and check it matches >= 1 sublayer, all of them `nn.Linear`."""
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    patterns = [str(p) for p in target_modules]
    if not patterns:
        raise ValueError("target_modules is empty: give regexes such as ['.*q_proj', '.*v_proj']")
    named = list(model.named_sublayers())
    linears = _linear_names(model)
    example = ", ".join(linears[:4]) + (", ..." if len(linears) > 4 else "")
    for pattern in patterns:
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise ValueError(
                f"LoRA target module pattern {pattern!r} is not a regex: {err}"
            ) from err
        hits = [(name, layer) for name, layer in named if regex.fullmatch(name)]
        if not hits:
            raise ValueError(
                f"LoRA target module pattern {pattern!r} matches no layer of "
                f"{type(model).__name__} (patterns must match the WHOLE name, e.g. "
                f"'.*q_proj'); its linear layers are named like: {example}"
            )
        bad = [name for name, layer in hits if not isinstance(layer, nn.Linear)]
        if bad:
            raise ValueError(
                f"LoRA target module pattern {pattern!r} matches {bad[0]!r} "
                f"({type(dict(named)[bad[0]]).__name__}), which is not an nn.Linear; LoRA "
                f"adapts linear layers only, e.g.: {example}"
            )
    return patterns


def lora_layers(model: nn.Layer) -> list[tuple[str, nn.Layer]]:
    """The (name, layer) pairs of the PaddleFormers LoRA layers inside `model`."""
    _, _, LoRALinear = _peft()
    return [(n, layer) for n, layer in model.named_sublayers() if isinstance(layer, LoRALinear)]


def apply_lora(
    model: CausalLM,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: Sequence[str],
) -> Any:
    """Wrap `model` in a PaddleFormers `LoRAModel`; only the adapters stay trainable.

    The matched `nn.Linear` layers are replaced in place by `LoRALinear` (sharing the original
    weight and bias), so `model` itself becomes the adapted model; the returned `LoRAModel`
    forwards calls to it. Raises `ValueError` for a bad rank/alpha/dropout, a pattern that
    matches nothing (the message names it) or a model that already has adapters.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be an integer >= 1, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    if lora_layers(model):
        raise ValueError("the model already has LoRA adapters: apply_lora once per model")
    patterns = _check_targets(model, target_modules)
    LoRAConfig, LoRAModel, _ = _peft()
    flashcp_config(model)
    dtype = next(
        (
            str(layer.weight.dtype).replace("paddle.", "")
            for name, layer in model.named_sublayers()
            if isinstance(layer, nn.Linear) and any(re.fullmatch(p, name) for p in patterns)
        ),
        None,
    )
    config = LoRAConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=float(dropout),
        target_modules=patterns,
        tensor_model_parallel_size=1,
        dtype=dtype,
    )
    with _quiet():
        lora = LoRAModel(model, config)
    lora.mark_only_lora_as_trainable()
    return lora


def trainable_parameters(model: nn.Layer) -> list[paddle.Tensor]:
    """The parameters an optimizer should update (those with `stop_gradient=False`)."""
    return [p for p in model.parameters() if not p.stop_gradient]


def save_adapters(lora_model: Any, directory: str | os.PathLike[str]) -> Path:
    """Write the adapter weights and `lora_config.json` with PaddleFormers' `save_pretrained`.

    Only adapter tensors are stored (safetensors shards + index), plus the model `config.json`.
    Saving a merged model is refused: merged adapters are already inside the base weights.
    """
    if any(getattr(layer, "merged", False) for _, layer in lora_layers(lora_model)):
        raise RuntimeError("the adapters are merged into the base weights: save before merging")
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"adapter directory {out} exists and is not a directory")
    with _quiet():
        lora_model.save_pretrained(str(out))
    return out


def load_adapters(model: CausalLM, directory: str | os.PathLike[str]) -> Any:
    """Apply the adapters saved in `directory` to a fresh `model` (`LoRAModel.from_pretrained`).

    The target modules, rank and alpha come from the saved `lora_config.json`. Raises
    `FileNotFoundError` when the directory holds no PaddleFormers adapters (PaddleFormers itself
    would only log an error and start from fresh adapters).
    """
    src = Path(directory)
    if not (src / LORA_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no LoRA adapters in {src}: {LORA_CONFIG_FILE} is missing")
    if not ((src / SAFE_INDEX_FILE).is_file() or (src / LEGACY_WEIGHTS_FILE).is_file()):
        raise FileNotFoundError(
            f"no LoRA adapter weights in {src}: expected {SAFE_INDEX_FILE} (or "
            f"{LEGACY_WEIGHTS_FILE}) as written by save_adapters"
        )
    LoRAConfig, LoRAModel, _ = _peft()
    config = LoRAConfig.from_pretrained(str(src))
    if lora_layers(model):
        raise ValueError("the model already has LoRA adapters: load into a fresh model")
    _check_targets(model, config.target_modules or [])
    flashcp_config(model)
    config.tensor_model_parallel_size = 1
    with _quiet():
        lora = LoRAModel.from_pretrained(model, str(src), lora_config=config)
    lora.mark_only_lora_as_trainable()
    return lora


def merge_adapters(lora_model: Any) -> CausalLM:
    """Fold the adapters into the base weights and return the plain model.

    PaddleFormers' `LoRAModel.merge()` does the folding (``W <- W + A·B·alpha/rank`` per layer;
    it works on CPU). Each `LoRALinear` is then swapped back for an `nn.Linear` sharing the
    merged weight and the original bias. (PaddleFormers' `restore_original_model()` is not used:
    it builds every replacement with a bias, so bias-free projections such as `o_proj` would
    gain zero `.bias` parameters and the state dict would no longer match the base model's.)
    Every parameter of the returned model is trainable again, as before `apply_lora`;
    `lora_model` must not be used afterwards.
    """
    with _quiet():
        lora_model.merge()
    model = lora_model.model
    for name, layer in lora_layers(model):
        parent = model
        *path, leaf = name.split(".")
        for part in path:
            parent = getattr(parent, part)
        in_features, out_features = (int(d) for d in layer.weight.shape)
        plain = nn.Linear(
            in_features, out_features, bias_attr=False if layer.bias is None else None
        )
        plain.weight = layer.weight
        if layer.bias is not None:
            plain.bias = layer.bias
        setattr(parent, leaf, plain)
    for p in model.parameters():
        p.stop_gradient = False
    return model


@contextlib.contextmanager
def disable_adapters(lora_model: Any) -> Iterator[Any]:
    """Run `lora_model` as its base model inside the block (e.g. DPO reference log-probs).

    Sets PaddleFormers' per-layer `disable_lora` flag (what `LoRAModel.disable_lora()` sets)
    and restores each layer's previous flag on exit, even on error. Merged adapters cannot be
    switched off (they live in the base weights), so that raises `RuntimeError`.
    """
    layers = [layer for _, layer in lora_layers(lora_model)]
    if not layers:
        raise ValueError("the model has no LoRA adapters to disable")
    if any(getattr(layer, "merged", False) for layer in layers):
        raise RuntimeError("the adapters are merged into the base weights and cannot be disabled")
    previous = [bool(layer.disable_lora) for layer in layers]
    for layer in layers:
        layer.disable_lora = True
    try:
        yield lora_model
    finally:
        for layer, flag in zip(layers, previous, strict=True):
            layer.disable_lora = flag
