"""Paddle objects ↔ plain data for checkpoints: the model's state as numpy, RNG as JSON.

Model arrays are keyed by structured name (`model.layers.0.self_attn.q_proj.weight`), so a
checkpoint loads into any freshly built model of the same shape (the optimizer's state:
`flashcp.checkpoint.optimizer_state`). Paddle's generator state has no public serialised form,
so it is pickled (base64 in the JSON); load checkpoints only from trusted places.
"""

from __future__ import annotations

import base64
import json
import pickle
import random
from typing import Any

import numpy as np
import paddle


def model_arrays(model: paddle.nn.Layer) -> dict[str, np.ndarray]:
    """Every parameter and persistent buffer as numpy, by structured name."""
    return {name: t.numpy() for name, t in model.state_dict().items()}


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


def rng_state() -> dict[str, Any]:
    """Python, numpy and Paddle RNG states as JSON-safe data (Paddle's seed/offset readable)."""
    paddle_states = paddle.get_rng_state()
    readable = [s.__getstate__()[:3] for s in paddle_states]
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
        "paddle": {
            "generators": [
                {"device": int(d), "seed": int(seed), "offset": int(off)}
                for d, seed, off in readable
            ],
            "state": base64.b64encode(pickle.dumps(paddle_states)).decode("ascii"),
        },
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()` output."""
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
         n["cached_gaussian"])
    )  # fmt: skip
    paddle.set_rng_state(pickle.loads(base64.b64decode(state["paddle"]["state"])))
