"""Optimizer state in checkpoints: the one place that knows how it is written and read, whatever
layout wrote it and whatever layout reads it.

Two saved forms:

* unsharded (`classic_arrays`, `ParamOptimizer`): `<name>::moment1_0`, `::moment2_0`,
  `::beta1_pow_acc_0`, `::beta2_pow_acc_0` arrays of the full parameter shapes, keyed by the
  parameter's structured name (Paddle's own tensor names come from a process-global counter, so
  they are mapped to structured names on save and back on load); the float32 parameters
  themselves are the master weights;
* shards (`MasterOptimizer`, one file per rank of a stage that writes one: `shard_file`,
  `writes_shard_file`, `shard_files`): packed float32 arrays `master`, `moment1`, `moment2`
  (the rank's segments back to back) and `beta1_pow`, `beta2_pow` (one entry per segment), with
  the segment map `[name, start, length, offset]` in the safetensors metadata (`SHARD_META`):
  the segment holds elements `[start, start + length)` of the flattened parameter `name` (of
  the FULL tensor: an expert-parallel rank's rows are offset by its first expert), at `offset`
  in the packed arrays.

`OptimizerSource` reads either form by (parameter, element range), so a checkpoint written by
one dp × cp (or unsharded) loads into any other (`load_state`): `ClassicSource` slices the full
arrays, `ShardSource` stitches a range together from the pieces of several shard files,
reading only those bytes (`safetensors.safe_open` slices).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import paddle
from safetensors import safe_open

from flashcp.checkpoint.experts import ExpertArrays
from flashcp.optim.zero import MasterOptimizer, MasterShard, ParamOptimizer

SEP = "::"
"""`<structured parameter name>::<accumulator>`: the unsharded form's keys."""
SHARD_META = "flashcp_optimizer_shard"
"""safetensors metadata key of a shard file's segment map (JSON)."""
ARRAYS = ("master", "moment1", "moment2", "beta1_pow", "beta2_pow")
CLASSIC = {"moment1": "moment1_0", "moment2": "moment2_0"}
"""Shard array -> Paddle's AdamW accumulator shaped like the parameter."""
BETAS = ("beta1_pow_acc_0", "beta2_pow_acc_0")
"""Paddle's AdamW beta-power accumulators (shape [1])."""

OptimizerType = ParamOptimizer | MasterOptimizer


# -- keys of the unsharded form ------------------------------------------------------------------


def param_name(key: str) -> str:
    """The parameter an unsharded-form key belongs to."""
    return key.partition(SEP)[0]


def optimizer_key(key: str) -> str | None:
    """`<param>::moment1_0` / `::moment2_0` are the parameter's rows (sliced like it under
    expert parallelism, `flashcp.checkpoint.experts`); beta powers are not."""
    name, _, acc = key.partition(SEP)
    return name if acc in CLASSIC.values() else None


def _name_maps(model: paddle.nn.Layer) -> tuple[dict[str, str], dict[str, str]]:
    structured_to_paddle = {n: p.name for n, p in model.named_parameters()}
    return structured_to_paddle, {v: k for k, v in structured_to_paddle.items()}


def optimizer_arrays(
    optimizer: paddle.optimizer.Optimizer, model: paddle.nn.Layer
) -> dict[str, np.ndarray]:
    """The optimizer's tensors keyed `<structured param name>::<accumulator>`."""
    _, to_structured = _name_maps(model)
    # longest names first, so `w_0` never shadows `w_0_x`
    names = sorted(to_structured, key=len, reverse=True)
    out = {}
    for key, value in optimizer.state_dict().items():
        if not isinstance(value, paddle.Tensor):
            continue  # LR_Scheduler etc.: saved with the trainer state
        owner = next((n for n in names if key.startswith(n + "_")), None)
        if owner is None:
            raise ValueError(f"optimizer state {key!r} belongs to no parameter of the model")
        out[f"{to_structured[owner]}{SEP}{key[len(owner) + 1 :]}"] = value.numpy()
    return out


def load_optimizer_arrays(
    optimizer: paddle.optimizer.Optimizer, model: paddle.nn.Layer, arrays: dict[str, np.ndarray]
) -> None:
    """Restore `optimizer_arrays` output into `optimizer` (before or after its first step)."""
    to_paddle, _ = _name_maps(model)
    state = {}
    for key, value in arrays.items():
        structured, _, acc = key.partition(SEP)
        if structured not in to_paddle:
            raise ValueError(
                f"optimizer state for {structured!r}, which the model does not have "
                "(was the checkpoint saved with another model config?)"
            )
        state[f"{to_paddle[structured]}_{acc}"] = paddle.to_tensor(value)
    optimizer.set_state_dict(state)


# -- shard files ---------------------------------------------------------------------------------


def fresh_betas(beta1: float, beta2: float) -> tuple[np.ndarray, np.ndarray]:
    """Paddle's AdamW beta-power accumulators before the first step."""
    return np.array([beta1], np.float32), np.array([beta2], np.float32)


@dataclass
class ShardArrays:
    """One shard's state as written to its file (see the module docstring)."""

    segments: list[tuple[str, int, int, int]]
    numel: dict[str, int]
    shards: int
    index: int
    master: np.ndarray
    moment1: np.ndarray
    moment2: np.ndarray
    beta1_pow: np.ndarray
    beta2_pow: np.ndarray

    def tensors(self) -> dict[str, np.ndarray]:
        return {k: np.ascontiguousarray(getattr(self, k), dtype=np.float32) for k in ARRAYS}

    def metadata(self) -> dict[str, str]:
        meta = {
            "segments": [list(s) for s in self.segments],
            "numel": self.numel,
            "shards": self.shards,
            "index": self.index,
        }
        return {SHARD_META: json.dumps(meta, sort_keys=True)}


def _numel(p: paddle.Tensor) -> int:
    return int(np.prod(p.shape)) if len(p.shape) else 1


def shard_arrays(shard: MasterShard) -> ShardArrays:
    """A master shard's state as packed float32 arrays plus its segment map (a segment without
    AdamW state yet saves zero moments and fresh beta powers)."""
    state = shard.inner.state_dict()
    b1, b2 = fresh_betas(shard.train.beta1, shard.train.beta2)

    def acc(m: paddle.Tensor, key: str, default: np.ndarray) -> np.ndarray:
        value = state.get(f"{m.name}_{key}")
        return value.numpy().reshape([-1]) if value is not None else default

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    masters = shard.masters
    zeros = [np.zeros(s.length, np.float32) for s in shard.segments]
    moments = {
        kind: cat([acc(m, name, z) for m, z in zip(masters, zeros, strict=True)])
        for kind, name in CLASSIC.items()
    }
    return ShardArrays(
        segments=[
            (s.name, s.start + shard.offsets.get(s.name, 0), s.length, s.offset)
            for s in shard.segments
        ],
        numel={n: shard.totals.get(n, _numel(p)) for n, p in shard.params.items()},
        shards=shard.layout.shards,
        index=shard.layout.index,
        master=cat([m.numpy() for m in masters]),
        moment1=moments["moment1"],
        moment2=moments["moment2"],
        beta1_pow=cat([acc(m, BETAS[0], b1) for m in masters]),
        beta2_pow=cat([acc(m, BETAS[1], b2) for m in masters]),
    )


def _flat_float32(p: paddle.Tensor, start: int, length: int) -> np.ndarray:
    """Elements [start, start + length) of flattened `p`, as float32."""
    with paddle.no_grad():
        return p.reshape([-1])[start : start + length].astype("float32").numpy()


def load_shard(shard: MasterShard, source: OptimizerSource) -> None:
    """Masters and AdamW state of every segment of `shard` from `source` (any saved layout).
    Without a saved master (an unsharded float32 checkpoint) the master is the parameter's
    value; a parameter without any saved state starts fresh, as Paddle's AdamW would."""
    state: dict[str, paddle.Tensor] = {}
    for seg, m in zip(shard.segments, shard.masters, strict=True):
        start = seg.start + shard.offsets.get(seg.name, 0)
        master = source.read(seg.name, "master", start, seg.length)
        if master is None:
            master = _flat_float32(shard.params[seg.name], seg.start, seg.length)
        m.set_value(master.astype(np.float32, copy=False))
        m1 = source.read(seg.name, "moment1", start, seg.length)
        m2 = source.read(seg.name, "moment2", start, seg.length)
        betas = source.beta_pows(seg.name)
        if m1 is None and m2 is None and betas is None:
            continue
        if m1 is None or m2 is None or betas is None:
            raise ValueError(
                f"the checkpoint's optimizer state of {seg.name!r} is incomplete (moments or "
                "beta powers missing): was it written by another flashcp version?"
            )
        state[f"{m.name}_{CLASSIC['moment1']}"] = paddle.to_tensor(m1)
        state[f"{m.name}_{CLASSIC['moment2']}"] = paddle.to_tensor(m2)
        state[f"{m.name}_{BETAS[0]}"] = paddle.to_tensor(betas[0].reshape([1]))
        state[f"{m.name}_{BETAS[1]}"] = paddle.to_tensor(betas[1].reshape([1]))
    if state:
        shard.inner.set_state_dict(state)


def _per_ep_rank(opt: MasterOptimizer) -> bool:
    """Unsharded under expert parallelism: one file per ep rank (the same count on every
    stage, whether or not it trains experts)."""
    return not opt.sharded and int(opt.ep.nranks) > 1


def shard_files(opt: MasterOptimizer) -> int:
    """Optimizer shard files per pipeline stage: one per rank (ZeRO-1), one per ep rank
    (unsharded under ep: its experts, the first also the replicated parameters), else one."""
    if opt.sharded:
        return opt.shards
    return int(opt.ep.nranks) if _per_ep_rank(opt) else 1


def writes_shard_file(opt: MasterOptimizer) -> bool:
    """Whether this rank writes an optimizer shard file (`shard_file`)."""
    if opt.sharded:
        return True
    if _per_ep_rank(opt):
        return int(opt.edp.rank) == 0
    return int(opt.cp.rank) == 0 and int(opt.dp.rank) == 0


def shard_file(opt: MasterOptimizer) -> ShardArrays:
    """This rank's optimizer shard file: its segments of every part (without ZeRO-1 under
    ep, only the first ep rank adds the replicated parameters, which every ep rank holds)."""
    if int(opt.ep.nranks) == 1:
        return shard_arrays(opt.shard)
    parts = opt.parts[1:] if _per_ep_rank(opt) and int(opt.ep.rank) > 0 else opt.parts
    arrays = [shard_arrays(part.shard) for part in parts]
    segments: list[tuple[str, int, int, int]] = []
    numel: dict[str, int] = {}
    offset = 0
    for a in arrays:
        segments += [(n, start, length, off + offset) for n, start, length, off in a.segments]
        numel.update(a.numel)
        offset += int(a.master.size)

    def cat(key: str) -> np.ndarray:
        found = [getattr(a, key) for a in arrays]
        return np.concatenate(found) if found else np.zeros(0, np.float32)

    index = opt.layout.index if opt.sharded else int(opt.ep.rank)  # per ep rank
    return ShardArrays(
        segments=segments,
        numel=numel,
        shards=shard_files(opt),
        index=index,
        **{key: cat(key) for key in ARRAYS},
    )


# -- reading either form ---------------------------------------------------------------------------


class OptimizerSource(Protocol):
    """Saved optimizer state, read by parameter name and element range."""

    def read(self, name: str, kind: str, start: int, length: int) -> np.ndarray | None:
        """Elements `[start, start + length)` of the flattened `kind` ("master", "moment1",
        "moment2") of parameter `name`, float32; None when the checkpoint has none."""
        ...

    def beta_pows(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The parameter's AdamW beta-power accumulators (shape [1] each), or None."""
        ...

    def classic(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
        """The unsharded form (`<name>::<accumulator>`) for the parameters in `shapes`."""
        ...


class ClassicSource:
    """The unsharded form (a dict of `<name>::<accumulator>` arrays)."""

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = dict(arrays)

    def read(self, name: str, kind: str, start: int, length: int) -> np.ndarray | None:
        if kind not in CLASSIC:
            return None  # the float32 parameters are the masters
        value = self.arrays.get(f"{name}{SEP}{CLASSIC[kind]}")
        if value is None:
            return None
        flat = value.reshape(-1)
        if start + length > flat.size:
            raise ValueError(
                f"checkpoint state {name}{SEP}{CLASSIC[kind]} has {flat.size} elements, the "
                f"model's parameter at least {start + length} (saved with another model config?)"
            )
        return np.asarray(flat[start : start + length], dtype=np.float32)

    def beta_pows(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        pair = [self.arrays.get(f"{name}{SEP}{b}") for b in BETAS]
        if pair[0] is None or pair[1] is None:
            return None
        return pair[0].reshape(1), pair[1].reshape(1)

    def classic(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
        return self.arrays


class ShardSource:
    """Shard files, grouped by the pipeline stage that wrote them (any dp × cp wrote them).

    A parameter held by two stages (a tied embedding) is read from the first stage holding it:
    both copies are equal, but each stage cut its own shard boundaries.
    """

    def __init__(self, stages: Sequence[Sequence[str | Path]]) -> None:
        self.files: list[Any] = []
        self.pieces: dict[str, list[tuple[int, int, int, int, int]]] = {}
        """name -> [(start, length, file index, offset, segment index)], sorted by start."""
        owner: dict[str, int] = {}
        for stage, paths in enumerate(stages):
            for path in paths:
                handle = safe_open(str(path), framework="numpy")
                meta_text = (handle.metadata() or {}).get(SHARD_META)
                if meta_text is None:
                    raise ValueError(f"{path} is not a flashcp optimizer shard (no segment map)")
                meta = json.loads(meta_text)
                f = len(self.files)
                self.files.append(handle)
                for i, (name, start, length, offset) in enumerate(meta["segments"]):
                    if owner.setdefault(name, stage) != stage:
                        continue
                    self.pieces.setdefault(name, []).append((start, length, f, offset, i))
        for items in self.pieces.values():
            items.sort()

    def read(self, name: str, kind: str, start: int, length: int) -> np.ndarray | None:
        items = self.pieces.get(name)
        if items is None:
            return None
        out = np.empty(length, np.float32)
        covered = 0
        end = start + length
        for p_start, p_len, f, offset, _ in items:
            a, z = max(start, p_start), min(end, p_start + p_len)
            if a >= z:
                continue
            lo = offset + (a - p_start)
            out[a - start : z - start] = self.files[f].get_slice(kind)[lo : lo + (z - a)]
            covered += z - a
        if covered != length:
            raise ValueError(
                f"the checkpoint's optimizer shards cover {covered} of elements "
                f"[{start}, {end}) of {name!r}: a shard file is missing"
            )
        return out

    def beta_pows(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        items = self.pieces.get(name)
        if items is None:
            return None
        _, _, f, _, i = items[0]
        h = self.files[f]
        return (
            np.asarray(h.get_slice("beta1_pow")[i : i + 1], np.float32),
            np.asarray(h.get_slice("beta2_pow")[i : i + 1], np.float32),
        )

    def classic(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, shape in shapes.items():
            if name not in self.pieces:
                continue
            n = int(np.prod(shape)) if len(shape) else 1
            for kind, acc in CLASSIC.items():
                value = self.read(name, kind, 0, n)
                assert value is not None
                out[f"{name}{SEP}{acc}"] = value.reshape(list(shape))
            betas = self.beta_pows(name)
            assert betas is not None
            for acc, value in zip(BETAS, betas, strict=True):
                out[f"{name}{SEP}{acc}"] = value
        return out


def source_for(
    classic: Mapping[str, np.ndarray], shard_files: Sequence[Sequence[str | Path]]
) -> OptimizerSource:
    """The source of a loaded checkpoint: its shard files (per stage) if it has any, else its
    unsharded arrays."""
    if any(shard_files):
        return ShardSource(shard_files)
    return ClassicSource(classic)


# -- an optimizer's whole state ------------------------------------------------------------------


def classic_arrays(opt: ParamOptimizer) -> dict[str, np.ndarray]:
    """A `ParamOptimizer`'s AdamW state in the unsharded form."""
    return optimizer_arrays(opt.inner, opt.setup.model)


def load_state(opt: OptimizerType, source: OptimizerSource, experts: ExpertArrays) -> None:
    """Restore `opt`'s state from `source` (any saved form and layout); `experts` slices an
    expert-parallel tensor's saved moments (whole on disk) to this rank's rows."""
    if isinstance(opt, MasterOptimizer):
        for part in opt.parts:
            load_shard(part.shard, source)
        return
    model = opt.setup.model
    shapes = {n: list(p.shape) for n, p in opt.setup.params}
    if not opt.experts:
        load_optimizer_arrays(opt.inner, model, source.classic(shapes))
        return
    full = source.classic(experts.global_shapes(shapes))
    load_optimizer_arrays(opt.inner, model, experts.slice(full, optimizer_key))
