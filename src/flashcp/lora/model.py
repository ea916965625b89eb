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
``model.layers.0.self_attn.q_proj``; every pattern must match at least one `nn.Linear` or
routed-experts layer (``.*mlp\\.experts``: per-expert adapters on both stacked projections,
through PaddleFormers' ``LoRAMoeExperts``; see `flashcp.lora.experts`).

Adapter math (PaddleFormers `LoRALinear`, Paddle weights are `[in, out]`):
``y = x W + b + dropout(x) A B · alpha / rank`` with A `[in, rank]` (Kaiming-uniform) and
B `[rank, out]` (zeros), so a fresh adapter leaves the model's output unchanged. Adapters are
float32; the base weight may be stored in bf16 (`CastingLoRALinear` upcasts it on CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import paddle
from paddle import nn

from flashcp.lora import experts as lora_experts
from flashcp.models.base import CausalLM
from flashcp.models.config import ModelArgs
from flashcp.models.experts import GroupedExperts
from flashcp.models.hf_config import exportable, hf_config
from flashcp.models.init import InitRule, fill_parameter
from flashcp.models.layers import Linear
from flashcp.models.precision import as_dtype, cast_linear, needs_cast

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
    shards sequences, not weights). The base model's Hugging Face config (`hf_config`: its HF
    ``architectures``, e.g. ``Glm4MoeForCausalLM``, and keys) and its `ModelArgs`
    (`flashcp_model_args`) go in, so the `config.json` PaddleFormers writes next to the adapters
    says which model they belong to.
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
    described: dict[str, Any] = {"architectures": [type(model).__name__]}
    if isinstance(args, ModelArgs) and not exportable(args):
        described = hf_config(args)  # the HF architecture and keys of the base model
    config = PretrainedConfig(
        **{
            **described,
            "tensor_model_parallel_size": 1,
            "tie_word_embeddings": bool(getattr(args, "tie_embeddings", False)),
            "flashcp_model_args": dataclasses.asdict(args)
            if dataclasses.is_dataclass(args)
            else {},
        }
    )
    model.config = config
    return config


def _linear_names(model: nn.Layer) -> list[str]:
    return [name for name, layer in model.named_sublayers() if isinstance(layer, nn.Linear)]


def _adaptable(layer: nn.Layer) -> bool:
    """LoRA adapts `nn.Linear` layers and stacked routed experts."""
    return isinstance(layer, (nn.Linear, GroupedExperts))


def _patterns(target_modules: Sequence[str] | str) -> list[str]:
    """The target patterns as a list, each compiled once to report a bad regex by name."""
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    patterns = [str(p) for p in target_modules]
    if not patterns:
        raise ValueError("target_modules is empty: give regexes such as ['.*q_proj', '.*v_proj']")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(
                f"LoRA target module pattern {pattern!r} is not a regex: {err}"
            ) from err
    return patterns


def target_summary(model: nn.Layer, target_modules: Sequence[str] | str) -> dict[str, Any]:
    """What the patterns match in `model` (one pipeline stage, or the whole model): per
    pattern the number of layers it matches and the first non-`nn.Linear` one (name, type),
    plus a few linear layer names for the error message. Picklable, so the stages of a
    pipeline can pool theirs (`check_targets`)."""
    patterns = _patterns(target_modules)
    named = list(model.named_sublayers())
    hits: dict[str, int] = {}
    bad: dict[str, tuple[str, str]] = {}
    for pattern in patterns:
        regex = re.compile(pattern)
        matched = [(name, layer) for name, layer in named if regex.fullmatch(name)]
        hits[pattern] = len(matched)
        wrong = [(n, type(sub).__name__) for n, sub in matched if not _adaptable(sub)]
        if wrong:
            bad[pattern] = wrong[0]
    return {
        "patterns": patterns,
        "hits": hits,
        "bad": bad,
        "examples": _linear_names(model)[:5],
        "model": type(model).__name__,
    }


def check_targets(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """Raise `ValueError` unless every pattern matches >= 1 layer in some summary (e.g. on
    some pipeline stage) and only `nn.Linear` or routed-experts layers anywhere; returns the
    patterns."""
    first = summaries[0]
    patterns = first["patterns"]
    examples = [n for s in summaries for n in s["examples"]]
    example = ", ".join(examples[:4]) + (", ..." if len(examples) > 4 else "")
    for pattern in patterns:
        if not any(s["hits"][pattern] for s in summaries):
            raise ValueError(
                f"LoRA target module pattern {pattern!r} matches no layer of "
                f"{first['model']} (patterns must match the WHOLE name, e.g. "
                f"'.*q_proj'); its linear layers are named like: {example}"
            )
        wrong = next((s["bad"][pattern] for s in summaries if pattern in s["bad"]), None)
        if wrong is not None:
            raise ValueError(
                f"LoRA target module pattern {pattern!r} matches {wrong[0]!r} "
                f"({wrong[1]}), which is not an nn.Linear; LoRA "
                f"adapts linear layers (e.g.: {example}) and routed experts ('.*mlp\\.experts')"
            )
    return patterns


def _check_targets(model: nn.Layer, target_modules: Sequence[str] | str) -> list[str]:
    """Compile each pattern and check it matches >= 1 sublayer, all of them adaptable."""
    return check_targets([target_summary(model, target_modules)])


ADAPTER_DTYPE = "float32"
"""Storage dtype of LoRA adapters (A, B) whatever the base weights' dtype."""

_CASTING: list[type] = []


def casting_lora_class() -> type:
    """`CastingLoRALinear`: PaddleFormers' `LoRALinear` whose forward upcasts a base weight
    stored in another dtype than the activations (bf16 storage on CPU).

    PaddleFormers' `LoRALinear.forward` calls `F.linear(input, self.weight, self.bias)` on the
    stored weight directly, which on CPU has no bf16 kernel; flashcp switches the class of the
    LoRA layers it creates to this subclass (same state, same PaddleFormers type checks). With
    equal dtypes it IS PaddleFormers' forward; otherwise the same math with the base weight
    through `flashcp.models.precision.cast_linear` (no float32 copy kept for backward).
    """
    if _CASTING:
        return _CASTING[0]
    _, _, LoRALinear = _peft()

    class CastingLoRALinear(LoRALinear):  # type: ignore[misc, valid-type]
        def forward(self, input: paddle.Tensor, *args: Any, **kwargs: Any) -> paddle.Tensor:
            if not needs_cast(input, self.weight, self.bias, self.lora_A, self.lora_B):
                return super().forward(input, *args, **kwargs)
            result = cast_linear(input, self.weight, self.bias)
            if not (self.disable_lora or self.merged):
                a = as_dtype(self.lora_A, input.dtype)
                b = as_dtype(self.lora_B, input.dtype)
                result += (self.lora_dropout(input) @ a @ b) * self.scaling
            return result

    _CASTING.append(CastingLoRALinear)
    return CastingLoRALinear


def _use_casting_layers(model: nn.Layer) -> None:
    cls = casting_lora_class()
    _, _, LoRALinear = _peft()
    for _, layer in lora_layers(model):
        if isinstance(layer, LoRALinear):
            layer.__class__ = cls


def lora_layers(model: nn.Layer) -> list[tuple[str, nn.Layer]]:
    """The (name, layer) pairs of the PaddleFormers LoRA layers inside `model`: `LoRALinear`s
    (`lora_A` / `lora_B`) and adapted routed experts (`lora_experts.is_expert_lora`)."""
    _, _, LoRALinear = _peft()
    return [
        (n, layer)
        for n, layer in model.named_sublayers()
        if isinstance(layer, LoRALinear) or lora_experts.is_expert_lora(layer)
    ]


def apply_lora(
    model: CausalLM,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: Sequence[str],
    seed: int | None = None,
    require_match: bool = True,
) -> Any:
    """Wrap `model` in a PaddleFormers `LoRAModel`; only the adapters stay trainable.

    The matched `nn.Linear` layers are replaced in place by `LoRALinear` (sharing the original
    weight and bias; see `CastingLoRALinear`), so `model` itself becomes the adapted model; the
    returned `LoRAModel` forwards calls to it. Adapters are float32 whatever the base weights'
    storage dtype (as Hugging Face PEFT keeps them by default). With `seed`, every adapter
    starts from (seed, its name) (`init_adapters`), so a pipeline stage gets the same adapters
    as one process; None keeps PaddleFormers' own init. Raises `ValueError` for a bad
    rank/alpha/dropout, a pattern that matches nothing (the message names it; skipped with
    `require_match=False`, for a pipeline stage whose stages were checked together) or a model
    that already has adapters.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be an integer >= 1, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    if lora_layers(model):
        raise ValueError("the model already has LoRA adapters: apply_lora once per model")
    patterns = _check_targets(model, target_modules) if require_match else _patterns(target_modules)
    LoRAConfig, LoRAModel, _ = _peft()
    lora_experts.prepare_targets(model, patterns)
    flashcp_config(model)
    config = LoRAConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=float(dropout),
        target_modules=patterns,
        tensor_model_parallel_size=1,
        dtype=ADAPTER_DTYPE,
    )
    with _quiet():
        lora = LoRAModel(model, config)
    _use_casting_layers(model)
    lora.mark_only_lora_as_trainable()
    if seed is not None:
        init_adapters(model, seed)
    return lora


def init_adapters(model: nn.Layer, seed: int) -> None:
    """Every adapter from (seed, its name) (`flashcp.models.init`): A `[in, r]` uniform in
    ±1/sqrt(in) — the distribution of PaddleFormers' `KaimingUniform(negative_slope=sqrt(5),
    nonlinearity="leaky_relu")` (gain sqrt(2 / (1 + 5)) times sqrt(3 / fan_in), fan_in = in)
    — and B zeros, so a fresh adapter leaves the model's output unchanged."""
    for name, layer in lora_layers(model):
        if lora_experts.is_expert_lora(layer):
            lora_experts.init_expert_adapters(name, layer, seed)
            continue
        fan_in = int(layer.lora_A.shape[0])
        rule = InitRule("uniform", 1.0 / math.sqrt(fan_in))
        fill_parameter(layer.lora_A, seed, f"{name}.lora_A", rule)
        fill_parameter(layer.lora_B, seed, f"{name}.lora_B", InitRule("zeros"))


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
    lora_experts.prepare_targets(model, list(config.target_modules or []))
    flashcp_config(model)
    config.tensor_model_parallel_size = 1
    with _quiet():
        lora = LoRAModel.from_pretrained(model, str(src), lora_config=config)
    _use_casting_layers(model)
    lora.mark_only_lora_as_trainable()
    return lora


def merge_adapters(lora_model: Any) -> CausalLM:
    """Fold the adapters into the base weights and return the plain model.

    PaddleFormers' `LoRAModel.merge()` does the folding (``W <- W + A·B·alpha/rank`` per layer;
    it works on CPU). Each `LoRALinear` is then swapped back for an `nn.Linear` sharing the
    merged weight and the original bias. (PaddleFormers' `restore_original_model()` is not used:
    it builds every replacement with a bias, so bias-free projections such as `o_proj` would
    gain zero `.bias` parameters and the state dict would no longer match the base model's.)
    The replacements are flashcp `Linear`s, so bf16-stored weights still compute on CPU.
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
        if lora_experts.is_expert_lora(layer):
            setattr(parent, leaf, lora_experts.plain_experts(layer))
            continue
        in_features, out_features = (int(d) for d in layer.weight.shape)
        plain = Linear(in_features, out_features, bias_attr=False if layer.bias is None else None)
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
