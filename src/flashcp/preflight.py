"""THE preflight of a config: every check `flashcp validate`, `flashcp train`, `flashcp eval`
and every launched rank make before compute that needs no launch (issue 38, item 1; the
launch's own checks — ports, the master, the run directory, the lock — are
`flashcp.launch.preflight`'s).

`check_raw` (of a file's mapping plus `key=value` overrides; `check_config_file`,
`preflight_problems` for a file or a loaded config): the config's own validation
(`flashcp.config.load`), then `static_problems`: this machine's device and compute dtype
(`flashcp.config.device_rule`) and the FlashAttention version the ranks will resolve under this
environment's flags and FA4 policy (`flashcp.fa_dispatch`), the memory plan against
`hardware.memory_gib` per device and `hardware.host_memory_gib` per node (`flashcp plan`), the
model directory's tensor index (`checkpoint.init_from` / `model.from_pretrained`: every layer
the model builds has tensors there), and a sample of the data (`data.path` and `eval.path`,
`DATA_SAMPLE_ROWS` rows read by the recipe's own data class: its tokenizer, format, chat
template and bad-record rules). An evaluation (`evaluating`) is checked for what it reads:
`eval.path` alone, and no training memory plan (it keeps no gradient or optimizer state).

Every check is `*_problems(...) -> list[Problem]` (`flashcp.problems`), each naming its key
and the fix, each fix validated through this same preflight before it is printed; the entry
point refuses with all of them at once (`flashcp.problems.ProblemsError`, exit code 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flashcp import fa_dispatch
from flashcp.config import Config, collect, to_dict
from flashcp.config import load as config_load
from flashcp.config.device_rule import DeviceError, compute_dtype, resolve_device
from flashcp.config.errors import prune_fixes
from flashcp.config.placeholders import is_placeholder
from flashcp.plan import plan
from flashcp.plan.report import device_budget_problems, host_budget_problems
from flashcp.problems import Problem, one_line

DATA_SAMPLE_ROWS = 64
"""Rows of `data.path` (and `eval.path`) the preflight reads, spread over the data."""
DISPATCH_KEY = "FlashAttention dispatch"
"""The key a dispatch refusal is reported under (its message names the flag and the policy)."""


def dispatch_problems(cfg: Config) -> list[Problem]:
    """Why the ranks could not resolve a FlashAttention version for `cfg`'s model under this
    environment's flags and the FA4 policy (`fa_dispatch.resolve_policy`: config > environment >
    error, as every rank resolves it), under `DISPATCH_KEY`. The head dims are checked against
    FA4's kernel limits; a mask's limits show per call."""
    try:
        inputs = fa_dispatch.probe_inputs(
            policy=fa_dispatch.resolve_policy(cfg.attention.fa4_unavailable),
            deterministic=cfg.train.deterministic,
        )
        head_dim = int(cfg.model.head_size)
        limit = None
        if inputs.requested == 4:
            limit = fa_dispatch.fa4_call_limit(
                mask_shape=None, num_kv_heads=int(cfg.model.num_kv_heads), head_dim=head_dim
            )
        # FA3/FA4 availability on this card included (`fa_dispatch.probe_inputs`).
        fa_dispatch.explain_inputs(inputs, head_dim, fa4_limit=limit)
    except (ValueError, NotImplementedError) as exc:
        return [Problem(DISPATCH_KEY, str(exc))]
    return []


def memory_problems(cfg: Config, nnodes: int | None = None) -> list[Problem]:
    """The memory plan against `hardware.memory_gib` per device and `hardware.host_memory_gib`
    per node (`flashcp.plan.report`'s budget problems; no check of a budget that is null);
    `nnodes`: the launch's nodes (ranks per node = dp·pp·cp / nnodes; default
    `hardware.gpus_per_node`). Each says how to launch without its check."""
    problems = []
    if cfg.hardware.memory_gib is not None:
        problems += [dataclasses.replace(x, problem=f"{x.problem}; or set hardware.memory_gib="
                                         "null to launch without the memory check")
                     for x in device_budget_problems(cfg, plan(cfg))]  # fmt: skip
    if cfg.hardware.host_memory_gib is not None:
        problems += [dataclasses.replace(x, problem=f"{x.problem}; or set hardware."
                                         "host_memory_gib=null to launch without the host "
                                         "memory check")
                     for x in host_budget_problems(plan(cfg, nnodes=nnodes))]  # fmt: skip
    return problems


def machine_problems(cfg: Config) -> list[Problem]:
    """This machine against `cfg`: a device and compute dtype Paddle runs here
    (`flashcp.config.device_rule`, the rule every rank applies) and the FlashAttention dispatch
    (`dispatch_problems`)."""
    from flashcp.rank_setup import gpu_visible

    problems = []
    try:
        compute_dtype(cfg, resolve_device(cfg, gpu_visible()))
    except DeviceError as exc:
        problems.append(exc.error)
    return problems + dispatch_problems(cfg)


def model_dir_problems(cfg: Config) -> list[Problem]:
    """The weights the ranks will load (`checkpoint.init_from`, implied by
    `model.from_pretrained`): their index holds every layer the model builds
    (`flashcp.models.hf_check.index_problems`; no tensor is read)."""
    path = cfg.checkpoint.init_from
    if path is None or is_placeholder(path):
        return []
    from flashcp.models.hf_check import index_problems

    key = "model.from_pretrained" if cfg.model_from_pretrained else "checkpoint.init_from"
    try:
        found = index_problems(path, cfg.model)
    except (OSError, ValueError) as exc:
        return [Problem(key, one_line(str(exc)))]
    return [dataclasses.replace(p, key=key) if p.key == "checkpoint.init_from" else p
            for p in found]  # fmt: skip


def data_problems(
    cfg: Config, warnings: list[str] | None = None, *, evaluating: bool = False
) -> list[Problem]:
    """A sample of `data.path` and `eval.path` (`DATA_SAMPLE_ROWS` rows, spread over each, each
    read once) read by the recipe's own data class as a rank reads it: a format the recipe
    reads (`flashcp.data.formats.check_data`: else the fields found, the formats accepted and
    the setting that would read them), tokenizer, chat template, bad-record policy, no usable
    record. Placeholders are left to the config's check. Bad records the sample held (which
    training skips, `data.on_bad_record: skip`) go to `warnings`: how many, and why."""
    from flashcp.recipes import recipe_class
    from flashcp.recipes.base import eval_config

    data_class = recipe_class(cfg.run.recipe).data_class
    problems: list[Problem] = []
    sets = [] if evaluating else [("data.path", cfg.data.path, cfg)]
    if cfg.eval.path is not None:
        sets.append(("eval.path", cfg.eval.path, eval_config(cfg, cfg.eval.path)))
    for key, path, each in sets:
        if path is not None and is_placeholder(path):
            continue
        try:
            data = data_class(each, dp_rank=0, dp_size=1, sample=DATA_SAMPLE_ROWS)
            bad = getattr(data, "bad_records", None)
            if warnings is not None and bad is not None and bad.total:
                reasons = bad.summary().split(": ", 1)[1]
                warnings.append(f"{key}: {bad.total} bad record(s) in a sample of "
                                f"{DATA_SAMPLE_ROWS} rows, which training skips "
                                f"(data.on_bad_record: skip): {reasons}")  # fmt: skip
        except (ValueError, OSError) as exc:
            message = one_line(str(exc))
            if not any(p.problem == message for p in problems):  # one tokenizer, one message
                problems.append(Problem(key, message))
    return problems


def static_problems(
    cfg: Config,
    *,
    nnodes: int | None = None,
    machine: bool = True,
    warnings: list[str] | None = None,
    evaluating: bool = False,
) -> list[Problem]:
    """Every check of a loaded (and so validated) `cfg` that needs no compute and no launch:
    this `machine`'s (device, dispatch), the memory plans, the model directory's index, a
    sample of the data (its bad records, which do not refuse, go to `warnings`). Fixes are not
    validated here (`preflight_problems` does). `evaluating`: what an evaluation reads (no
    training memory plan, no `data.path`)."""
    problems = machine_problems(cfg) if machine else []
    if not evaluating:
        problems += memory_problems(cfg, nnodes)
    problems += model_dir_problems(cfg)
    problems += data_problems(cfg, warnings, evaluating=evaluating)
    return problems


def check_raw(
    raw: Mapping[str, Any],
    *,
    source: str | None = None,
    overrides: Sequence[str] = (),
    world_size: int | None = None,
    nnodes: int = 1,
    machine: bool = True,
    allow_placeholders: bool = False,
    evaluating: bool = False,
) -> tuple[Config | None, list[Problem]]:
    """THE preflight of a config (a file's mapping plus `key=value` overrides, for
    `world_size` processes on `nnodes` nodes): its validation (`flashcp.config.collect`), then,
    when it is valid, `static_problems`. Every problem keeps only the fixes that pass this whole
    preflight once applied (`flashcp.config.errors.prune_fixes`), so no refusal suggests a
    change that would be refused in turn. `evaluating`: `flashcp eval`'s (`static_problems`)."""
    per_node = nnodes if nnodes > 1 else None

    def run(extra: Sequence[str]) -> tuple[Config | None, list[Problem]]:
        cfg, errors = collect(
            raw, source=source, overrides=[*overrides, *extra], world_size=world_size,
            nnodes=nnodes, allow_placeholders=allow_placeholders, validate_fixes=False,
        )  # fmt: skip
        if errors or cfg is None:
            return cfg, errors
        return cfg, static_problems(cfg, nnodes=per_node, machine=machine, warnings=warnings,
                                    evaluating=evaluating)

    warnings: list[str] = []
    cfg, problems = run(())
    if cfg is not None and warnings:  # the first run's: shown with the config's own notes
        cfg = dataclasses.replace(cfg, notes=(*cfg.notes, *(f"warning: {w}" for w in warnings)))
    if any(p.fixes for p in problems):
        problems = prune_fixes(problems, lambda extra: run(extra)[1])
    return cfg, problems


def check_config_file(
    path: str | Path, overrides: Sequence[str] = (), **kwargs: Any
) -> tuple[Config | None, list[Problem]]:
    """`check_raw` of the YAML file at `path` (unreadable: `ProblemsError`)."""
    return check_raw(config_load.read_yaml(path), source=str(path), overrides=overrides, **kwargs)


def preflight_problems(
    cfg: Config,
    *,
    world_size: int | None = None,
    nnodes: int = 1,
    machine: bool = True,
    allow_placeholders: bool = False,
    evaluating: bool = False,
) -> list[Problem]:
    """`check_raw` of a loaded `cfg` (from `cfg.source` and `cfg.overrides`, or its resolved
    mapping when built in code): what its launch (`flashcp.launch.preflight.preflight`)
    refuses."""
    raw = config_load.read_yaml(cfg.source) if cfg.source else to_dict(cfg)
    _, problems = check_raw(
        raw, source=cfg.source, overrides=cfg.overrides, world_size=world_size, nnodes=nnodes,
        machine=machine, allow_placeholders=allow_placeholders, evaluating=evaluating,
    )  # fmt: skip
    return problems


