"""Cross-field checks of a typed `Config`: `check_config` runs every rule, in order — the
layout's (`flashcp.config.layout_rules`), the run's recipe's (`RecipeSpec.rules`,
`flashcp.config.recipes`), and those here: attention masks, model, training, files, run,
reporting, evaluation and hardware.

Everything here runs without building the model or touching a GPU, so the real-shape configs
(GLM-4 9B on 8 GPUs) validate on a laptop. Each problem names its dotted key and the change
that fixes it; checks whose keys already failed type-checking are skipped (no cascades).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable
from pathlib import Path

from flashcp.config.checks import Checks, positive
from flashcp.config.errors import suggest
from flashcp.config.layout_rules import (
    check_attention,
    check_cp_mode,
    check_lengths,
    check_parallel,
)
from flashcp.config.recipe_spec import RECIPES, data_formats
from flashcp.config.schema import DATA_SUFFIXES, PREEMPT_SIGNALS, REPORT_BACKENDS, Config
from flashcp.problems import Problem

BYTE_VOCAB_SIZE = 259
"""256 byte ids + BOS, EOS and PAD (`flashcp.data.tokenizer.ByteTokenizer`)."""


_WINDOWED = ("sliding_window", "global_window")


def _check_mask(cfg: Config, c: Checks) -> None:
    """`attention.mask` and its parameters: each parameter set exactly for the masks that read
    it, in range (which masks a recipe trains with, and what its prefix is, are its rules)."""
    a = cfg.attention
    mask = a.mask
    if not c.ok("attention.mask"):
        return
    if mask == "prefix_lm" and getattr(cfg.model, "mtp_trained", False):
        c.add(
            "attention.mask",
            "prefix_lm with trained multi-token prediction (model.mtp_loss_weight > 0) would "
            "train on seen targets: an MTP row holds the embedding of a later token, and "
            "under prefix_lm an earlier prefix row sees it. Set model.mtp_loss_weight: 0 "
            "(the MTP layers carried frozen) or use a causal mask",
            "model.mtp_loss_weight",
        )
    window = a.sliding_window
    if mask in _WINDOWED and window is None:
        c.add(
            "attention.sliding_window",
            f"attention.mask {mask} needs attention.sliding_window: the keys each token sees, "
            "itself included (e.g. 4096, a model's config.json sliding_window)",
            "attention.mask",
        )
    elif mask in _WINDOWED and window is not None and window < 1:
        c.add("attention.sliding_window", f"must be >= 1 (a token sees itself), got {window}")
    elif mask not in _WINDOWED and window is not None:
        c.add(
            "attention.sliding_window",
            f"is read only with attention.mask sliding_window or global_window, but "
            f"attention.mask is {mask}: set attention.mask: sliding_window, or remove "
            "attention.sliding_window",
            "attention.mask",
        )
    g = a.global_tokens
    if mask == "global_window" and g < 1:
        c.add(
            "attention.global_tokens",
            f"attention.mask global_window needs attention.global_tokens >= 1 (the first "
            f"tokens of each document every later token sees), got {g}; or use "
            "attention.mask: sliding_window",
            "attention.mask",
        )
    elif mask != "global_window" and g != 0:
        c.add(
            "attention.global_tokens",
            f"is read only with attention.mask global_window, but attention.mask is {mask}: "
            "set attention.mask: global_window (with attention.sliding_window), or remove "
            "attention.global_tokens",
            "attention.mask",
        )
    _check_prefix(cfg, c)


def _check_prefix(cfg: Config, c: Checks) -> None:
    """`attention.prefix_len` is read only under prefix_lm (what the prefix is there is the
    recipe's rule: `flashcp.config.recipes`)."""
    a = cfg.attention
    if a.mask != "prefix_lm" and a.prefix_len is not None:
        c.add(
            "attention.prefix_len",
            f"is read only with attention.mask prefix_lm, but attention.mask is {a.mask}: "
            "set attention.mask: prefix_lm, or remove attention.prefix_len",
            "attention.mask",
        )


def _check_model(cfg: Config, c: Checks) -> None:
    m = cfg.model
    problems = getattr(m, "problems", None)
    reported: set[str] = set()
    if callable(problems):
        for found in problems():
            reported.add(found.key)
            c.add(found.key, found.problem)
    heads, kv = getattr(m, "num_heads", None), getattr(m, "num_kv_heads", None)
    if (
        isinstance(heads, int)
        and isinstance(kv, int)
        and kv > 0
        and heads % kv
        and not reported & {"model.num_heads", "model.num_kv_heads"}
    ):
        c.add(
            "model.num_kv_heads",
            f"model.num_heads ({heads}) must be a multiple of model.num_kv_heads ({kv}) for "
            "grouped-query attention",
            "model.num_heads",
        )
    layers = getattr(m, "num_layers", None)
    if isinstance(layers, int) and layers < cfg.parallel.pp:
        c.add(
            "model.num_layers",
            f"{layers} layers cannot fill parallel.pp = {cfg.parallel.pp} pipeline stages",
            fixes=[{"parallel.pp": max(layers, 1)}, {"model.num_layers": cfg.parallel.pp}],
        )
    vocab = getattr(m, "vocab_size", None)
    if cfg.data.tokenizer == "byte" and isinstance(vocab, int) and vocab < BYTE_VOCAB_SIZE:
        c.add(
            "model.vocab_size",
            f"{vocab} is smaller than the byte tokenizer's {BYTE_VOCAB_SIZE} ids",
            "data.tokenizer",
            fixes=[{"model.vocab_size": BYTE_VOCAB_SIZE}],
        )


def _check_train(cfg: Config, c: Checks) -> None:
    t = cfg.train
    if t.steps < 1:
        c.add("train.steps", f"must be >= 1, got {t.steps}")
    positive(c, "train.lr", t.lr)
    if t.min_lr is not None:
        positive(c, "train.min_lr", t.min_lr, zero_ok=True)
        if c.ok("train.lr", "train.min_lr") and t.min_lr > t.lr:
            c.add("train.min_lr", f"{t.min_lr} is above train.lr {t.lr} (the decay's floor)",
                  fixes=[{"train.min_lr": None}, {"train.min_lr": t.lr}])  # fmt: skip
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        c.add("train.min_lr_ratio", f"must be in [0, 1] (a fraction of train.lr), got "
                                    f"{t.min_lr_ratio}")  # fmt: skip
    if t.warmup_steps is not None and t.warmup_steps < 0:
        c.add("train.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    if t.epochs is not None and not (math.isfinite(t.epochs) and t.epochs > 0):
        c.add("train.epochs", f"must be > 0 (passes over the data), got {t.epochs}")
    positive(c, "train.weight_decay", t.weight_decay, zero_ok=True)
    for key, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0.0 <= beta < 1.0:
            c.add(key, f"must be in [0, 1), got {beta}")
    positive(c, "train.eps", t.eps)
    positive(c, "train.grad_clip", t.grad_clip, zero_ok=True)
    if t.grad_accum < 1:
        c.add("train.grad_accum", f"must be >= 1, got {t.grad_accum}")
    if t.log_every < 1:
        c.add("train.log_every", f"must be >= 1, got {t.log_every}")
    if t.seed < 0:
        c.add("train.seed", f"must be >= 0, got {t.seed}")
    recompute = getattr(cfg.model, "recompute", None)
    if t.offload_activations and recompute == "none":
        c.add(
            "train.offload_activations",
            "moves what a RECOMPUTED layer keeps (its input) to host memory, but "
            "model.recompute is none (autograd keeps every layer's intermediates, which are not "
            "moved)",
            "model.recompute",
            fixes=[
                {"model.recompute": "full"},
                {"model.recompute": "refined"},
                {"train.offload_activations": False},
            ],  # fmt: skip
        )
    if t.loss_chunk_tokens < 0:
        c.add(
            "train.loss_chunk_tokens",
            f"must be >= 0 (0 = unchunked), got {t.loss_chunk_tokens}",
            fixes=[{"train.loss_chunk_tokens": 4096}],
        )
    gib = cfg.hardware.memory_gib
    if gib is not None and not gib > 0:
        c.add("hardware.memory_gib", f"must be > 0 GiB or null (no budget), got {gib}")
    if t.dtype == "bfloat16" and cfg.run.device == "cpu":
        c.add(
            "train.dtype",
            "bfloat16 needs a GPU (run.device is cpu)",
            "run.device",
            fixes=[{"train.dtype": "auto"}, {"train.dtype": "float32"}, {"run.device": "gpu"}],
        )
    if t.dtype == "float32" and cfg.run.device == "gpu":
        c.add(
            "train.dtype",
            "float32 cannot run on a GPU (run.device is gpu): every attention layer calls "
            "Paddle's FlashAttention/FlashMask kernels, which exist for float16/bfloat16 only",
            "run.device",
            fixes=[{"train.dtype": "auto"}, {"train.dtype": "bfloat16"}, {"run.device": "cpu"}],
        )


def _check_files(cfg: Config, c: Checks) -> None:
    d = cfg.data
    path = None if d.path is None else Path(d.path)
    if path is not None and not path.exists():
        c.add(
            "data.path",
            f"no file or directory at {d.path!r}: give a JSON Lines or Parquet file (or a "
            "directory of them), or null for the built-in data",
        )
    elif path is not None and path.is_file() and path.suffix.lower() not in DATA_SUFFIXES:
        c.add(
            "data.path",
            f"{d.path!r} is not a JSON Lines (.jsonl, .json) or Parquet (.parquet) file: give "
            "one of those, a directory of them, or null for the built-in data",
        )
    elif (
        path is not None
        and path.is_dir()
        and not any(f.suffix.lower() in DATA_SUFFIXES for f in path.iterdir() if f.is_file())
    ):
        c.add(
            "data.path",
            f"the directory {d.path!r} holds no .jsonl, .json or .parquet files: give a data "
            "file or a directory of them, or null for the built-in data",
        )
    formats = data_formats()
    if d.format not in formats:
        c.add("data.format", f"unknown format {d.format!r}" + suggest(d.format, formats))
    elif d.format != "auto" and cfg.run.recipe not in formats[d.format]:
        fits = [name for name, recipes in formats.items() if cfg.run.recipe in recipes]
        c.add(
            "data.format",
            f"{d.format} is a format of run.recipe {' / '.join(formats[d.format])}, not "
            f"{cfg.run.recipe}: set data.format to one of {', '.join(fits)}",
            "run.recipe",
        )
    tok = Path(d.tokenizer)
    if d.tokenizer != "byte" and tok.is_dir() and not (tok / "tokenizer.json").is_file():
        c.add(
            "data.tokenizer",
            f"the directory {d.tokenizer!r} has no tokenizer.json (with model.from_pretrained "
            "the model directory is the default): set data.tokenizer to a tokenizer directory, "
            "a tokenizer.json file, or byte",
        )
    elif d.tokenizer != "byte" and not (tok.is_file() or tok.is_dir()):
        c.add(
            "data.tokenizer",
            f"{d.tokenizer!r} is neither 'byte', a tokenizer.json file nor a directory holding one",
        )


def _check_run(cfg: Config, c: Checks) -> None:
    if cfg.run.recipe not in RECIPES:
        c.add("run.recipe", f"unknown recipe {cfg.run.recipe!r}" + suggest(cfg.run.recipe,
                                                                           RECIPES))  # fmt: skip
    if cfg.run.stop_after_steps < 0:
        c.add("run.stop_after_steps", f"must be >= 0 (0 = no early stop), got "
                                      f"{cfg.run.stop_after_steps}")  # fmt: skip
    if not cfg.run.output_dir.strip():
        c.add("run.output_dir", "must be a non-empty directory path")
    _check_long_jobs(cfg, c)
    spec = RECIPES.get(cfg.run.recipe)
    for name in cfg.extras:
        if spec is None or name not in spec.sections:
            users = [r for r, s in RECIPES.items() if name in s.sections]
            c.add(
                name,
                f"section is read only by recipe(s) {', '.join(users)}",
                "run.recipe",
                # `{name}=null` removes an optional section (`flashcp.config.load`)
                fixes=[{"run.recipe": r} for r in users] + [{name: None}],
            )
    ck = cfg.checkpoint
    if ck.every < 0:
        c.add("checkpoint.every", f"must be >= 0 (0 = no periodic saves), got {ck.every}")
    if ck.keep_last < 1:
        c.add("checkpoint.keep_last", f"must be >= 1, got {ck.keep_last}")
    if ck.init_from is not None and not Path(ck.init_from).exists():
        c.add(
            "checkpoint.init_from",
            f"no checkpoint at {ck.init_from!r}: give a safetensors file or a directory with "
            "model.safetensors (or its index), or null for random init",
        )
    if ck.resume not in ("auto", "never") and not Path(ck.resume).is_dir():
        c.add(
            "checkpoint.resume",
            f"{ck.resume!r} is not 'auto', 'never' or an existing checkpoint directory",
        )
    elif cfg.run.overwrite and ck.resume not in ("auto", "never"):
        out, source = Path(cfg.run.output_dir).resolve(), Path(ck.resume).resolve()
        if source == out or out in source.parents:
            c.add(
                "run.overwrite",
                f"true moves run.output_dir {cfg.run.output_dir} aside before the run, but "
                f"checkpoint.resume {ck.resume!r} is inside it",
                "run.output_dir",
                fixes=[{"run.overwrite": False}],
                other="resume from a checkpoint outside run.output_dir",
            )


def _check_long_jobs(cfg: Config, c: Checks) -> None:
    """Restarts, pre-emption and straggler detection (`run.*`)."""
    r = cfg.run
    if r.max_restarts < 0:
        c.add("run.max_restarts", f"must be >= 0 (0 = no automatic restart), got "
                                  f"{r.max_restarts}", fixes=[{"run.max_restarts": 0}])  # fmt: skip
    positive(c, "run.restart_backoff_s", r.restart_backoff_s, zero_ok=True)
    positive(c, "run.preempt_grace_s", r.preempt_grace_s)
    if r.preempt_signal is not None and r.preempt_signal not in PREEMPT_SIGNALS:
        c.add("run.preempt_signal", f"{r.preempt_signal!r} is not a pre-emption signal: use "
                                    f"one of {', '.join(PREEMPT_SIGNALS)}, or null for SIGTERM "
                                    "only", fixes=[{"run.preempt_signal": "SIGUSR1"},
                                                   {"run.preempt_signal": None}])  # fmt: skip
    if not r.straggler_ratio > 1:
        c.add("run.straggler_ratio", f"must be > 1 (times the median compute time), got "
                                     f"{r.straggler_ratio}",
              fixes=[{"run.straggler_ratio": 1.2}])  # fmt: skip
    if r.straggler_window < 0:
        c.add("run.straggler_window", f"must be >= 0 steps (0 = no straggler detection), got "
                                      f"{r.straggler_window}",
              fixes=[{"run.straggler_window": 20}, {"run.straggler_window": 0}])  # fmt: skip


def _check_report_to(cfg: Config, c: Checks) -> None:
    """Known backends, and the package each one needs importable here (before any launch)."""
    problems = []
    for name in cfg.run.report_to:
        if name not in REPORT_BACKENDS:
            choices = suggest(name, REPORT_BACKENDS).replace("valid keys", "backends")
            problems.append(f"unknown backend {name!r}{choices}")
            continue
        need = REPORT_BACKENDS[name]
        if need is not None and importlib.util.find_spec(need[0]) is None:
            problems.append(
                f"{name!r} needs the {need[1]} package, which is not installed here: "
                f"pip install {need[1]}, or remove {name!r} from run.report_to"
            )
    if problems:
        c.add("run.report_to", "; ".join(problems))


def _check_eval(cfg: Config, c: Checks) -> None:
    e = cfg.eval
    if e.every < 0:
        c.add("eval.every", f"must be >= 0 (0 = only after the last step), got {e.every}")
    if e.max_batches is not None and e.max_batches < 1:
        c.add("eval.max_batches", f"must be >= 1 or null (one pass), got {e.max_batches}")
    if e.path is not None and not Path(e.path).is_file():
        c.add(
            "eval.path",
            f"no file at {e.path!r}: give a file in the training data's format, or null for no "
            "evaluation",
        )
    peak = cfg.hardware.peak_tflops
    if peak is not None and not peak > 0:
        c.add("hardware.peak_tflops", f"must be > 0 or null (no MFU), got {peak}")


def _check_hardware(cfg: Config, c: Checks) -> None:
    """The host budget, the margins kept free, node size and host-link bandwidth of
    `hardware` (the device budget and peak TFLOP/s are checked with the keys they belong
    to)."""
    hw = cfg.hardware
    host = hw.host_memory_gib
    if host is not None and not host > 0:
        c.add("hardware.host_memory_gib", f"must be > 0 GiB per node or null (no host budget), "
                                          f"got {host}")  # fmt: skip
    for key in ("memory_headroom", "host_memory_reserve"):
        value = getattr(hw, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            c.add(f"hardware.{key}", f"must be a fraction in [0, 1) of the budget kept free, got "
                                     f"{value!r}: e.g. 0.05")  # fmt: skip
    per_node = hw.gpus_per_node
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        c.add("hardware.gpus_per_node", f"must be an integer >= 1 (devices per node), got "
                                        f"{per_node!r}")  # fmt: skip
    link = hw.host_link_gb_per_s
    if link is not None and not link > 0:
        c.add(
            "hardware.host_link_gb_per_s",
            f"must be > 0 GB/s or null (no copy-time estimate), got {link}: e.g. 50 for a "
            "PCIe Gen5 x16 link",
        )
    write = hw.checkpoint_write_gb_per_s
    if write is not None and not write > 0:
        c.add("hardware.checkpoint_write_gb_per_s", f"must be > 0 GB/s or null (judged from the "
                                                    f"first save), got {write}",
              fixes=[{"hardware.checkpoint_write_gb_per_s": None}])  # fmt: skip


def _check_recipe(cfg: Config, c: Checks) -> None:
    """The run's recipe's own rules (`RecipeSpec.rules`), before the core mask and length
    rules: they say what the rest of the config may be under it (dpo: a causal mask)."""
    spec = RECIPES.get(cfg.run.recipe)
    for rule in spec.rules if spec is not None else ():
        rule(cfg, c)


def check_config(
    cfg: Config, *, world_size: int | None = None, nnodes: int = 1, skip: Iterable[str] = ()
) -> list[Problem]:
    """Every cross-field problem of `cfg` (for a job of `world_size` processes, if known, on
    `nnodes` nodes: dp·pp·cp must equal nnodes × processes per node)."""
    c = Checks(skip)
    check_parallel(cfg, c, world_size, nnodes)
    check_cp_mode(cfg, c)
    check_attention(cfg, c)
    _check_recipe(cfg, c)
    _check_mask(cfg, c)
    check_lengths(cfg, c)
    _check_model(cfg, c)
    _check_train(cfg, c)
    _check_files(cfg, c)
    _check_run(cfg, c)
    _check_report_to(cfg, c)
    _check_eval(cfg, c)
    _check_hardware(cfg, c)
    return c.problems
