"""Paddle objects ↔ plain data for checkpoints: the model's state as numpy, RNG as JSON.

Model arrays are keyed by structured name (`model.layers.0.self_attn.q_proj.weight`), so a
checkpoint loads into any freshly built model of the same shape (the optimizer's state:
`flashcp.checkpoint.optimizer_state`).

RNG: Python's and numpy's states, and the generator of the device this process computes on —
one entry, as plain numbers: its seed and offset (all a CUDA Philox generator has), plus, for
the CPU generator, its mt19937_64 engine state as the decimal text the C++ library prints.
`paddle.get_rng_state()` would hold one state per VISIBLE GPU, and `paddle.set_rng_state`
refuses a list of another length, so a job resumed with another visible count crashed; and it
had to be pickled. Reading a checkpoint never unpickles: a checkpoint of the earlier format
(one entry per visible device plus a pickled copy) is read from its plain entries only, the
one of the current device index (else the first); its CPU engine was only in the pickle, so
the CPU generator is re-seeded from the saved seed there.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import numpy as np
import paddle
from paddle.base import core

from flashcp.device import host_array


def model_arrays(model: paddle.nn.Layer) -> dict[str, np.ndarray]:
    """Every parameter and persistent buffer as numpy, by structured name."""
    return {name: host_array(t) for name, t in model.state_dict().items()}


def load_model_arrays(model: paddle.nn.Layer, arrays: dict[str, np.ndarray]) -> None:
    """Set `model`'s state from `model_arrays` output; `ValueError` on any mismatch."""
    own = model.state_dict()
    missing = sorted(set(own) - set(arrays))
    extra = sorted(set(arrays) - set(own))
    if missing or extra:
        raise ValueError(
            "checkpoint does not match the model: "
            + (f"missing {missing[:5]}{'...' if len(missing) > 5 else ''} " if missing else "")
            + (f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}" if extra else "")
            + " (was it saved with another model config?)"
        )
    for name, tensor in own.items():
        value = arrays[name]
        if tuple(value.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {name} has shape {list(value.shape)}, the model "
                f"{list(tensor.shape)}"
            )
        tensor.set_value(value.astype(tensor.numpy().dtype, copy=False))


def device_generator() -> tuple[int, Any]:
    """(device index, generator) of the device this process computes on: the current GPU's
    CUDA generator, or (-1, the CPU generator)."""
    device = str(paddle.get_device())
    if device.startswith("gpu"):
        index = int(device.partition(":")[2] or 0)
        return index, core.default_cuda_generator(index)
    return -1, core.default_cpu_generator()


_ENGINE = re.compile(r"^[0-9]+( [0-9]+)*$")
"""The text of a `std::mt19937_64` state (`operator<<`): numbers separated by spaces."""


def generator_state(generator: Any) -> dict[str, Any]:
    """`generator`'s state as plain numbers: seed, offset and, for a CPU generator, its engine
    text (`GeneratorState.__getstate__`: (device, seed, offset[, engine bytes]))."""
    raw = generator.get_state().__getstate__()
    out: dict[str, Any] = {"device": int(raw[0]), "seed": int(raw[1]), "offset": int(raw[2])}
    if len(raw) > 3 and int(raw[0]) < 0:  # the CPU engine; a CUDA generator is seed + offset
        out["engine"] = bytes(raw[3]).decode("ascii")
    return out


def _number(entry: dict[str, Any], key: str) -> int:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"checkpoint rng.paddle.generators: {key}={value!r} is not a valid integer"
        )
    return value


def set_generator_state(generator: Any, index: int, entry: dict[str, Any]) -> None:
    """Set `generator` (of device `index`, -1: CPU) from a `generator_state` entry."""
    seed, offset = _number(entry, "seed"), _number(entry, "offset")
    values: tuple[Any, ...] = (index, seed, offset)
    engine = entry.get("engine")
    if index < 0 and engine is not None:
        if not isinstance(engine, str) or not _ENGINE.match(engine):
            raise ValueError(
                "checkpoint rng.paddle.generators: engine is not the text of an mt19937_64 "
                "state (decimal numbers separated by spaces)"
            )
        values = (*values, list(engine.encode("ascii")))
    state = core.GeneratorState.__new__(core.GeneratorState)
    state.__setstate__(values)
    generator.set_state(state)


def rng_state() -> dict[str, Any]:
    """Python, numpy and this device's Paddle RNG states as JSON-safe data (module doc)."""
    _, generator = device_generator()
    np_state = np.random.get_state()
    return {
        "python": json.loads(json.dumps(random.getstate())),
        "numpy": {
            "kind": np_state[0],
            "keys": np_state[1].tolist(),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "paddle": {"generators": [generator_state(generator)]},
    }


def saved_generator(entries: list[dict[str, Any]], index: int) -> dict[str, Any]:
    """The entry to restore on device `index`: the only one (this format), else (a checkpoint
    with one entry per visible GPU) the one of the same device index, else the first."""
    if not entries:
        raise ValueError("checkpoint rng.paddle.generators is empty")
    if len(entries) == 1:
        return entries[0]
    return next((e for e in entries if e.get("device") == index), entries[0])


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()` output (or the earlier format's plain entries; never a pickle)."""
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
         n["cached_gaussian"])
    )  # fmt: skip
    index, generator = device_generator()
    set_generator_state(generator, index, saved_generator(state["paddle"]["generators"], index))
