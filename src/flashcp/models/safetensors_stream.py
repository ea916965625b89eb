"""Write a safetensors file one tensor at a time (never the whole file's tensors in memory).

`safetensors.numpy.save_file` needs every tensor of the file at once. A streamed export (a
pipeline stage's merged weights) instead knows each tensor's key, dtype and shape up front and
produces the values one by one: the header (8-byte little-endian length, then JSON with each
tensor's dtype, shape and byte range, padded with spaces to a multiple of 8, as the format
specifies) is written first, then each tensor's bytes in key order. The file reads back with
`safetensors.safe_open` like any other.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ITEM_SIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1}
"""Bytes per element of the safetensors dtypes flashcp writes."""
PADDLE_DTYPES = {
    "paddle.float64": "F64",
    "paddle.float32": "F32",
    "paddle.bfloat16": "BF16",
    "paddle.float16": "F16",
    "paddle.int64": "I64",
    "paddle.int32": "I32",
    "paddle.uint8": "U8",
}


def safetensors_dtype(dtype: object) -> str:
    """The safetensors dtype code of a Paddle dtype (e.g. `paddle.bfloat16` -> "BF16")."""
    code = PADDLE_DTYPES.get(str(dtype))
    if code is None:
        raise ValueError(f"no safetensors dtype for {dtype}")
    return code


@dataclass
class TensorSpec:
    """One tensor of a streamed file: its key, dtype code, shape, and how to produce it.

    `produce()` returns a numpy array of exactly `shape` whose item size is the dtype's
    (bfloat16 as Paddle's `uint16` view); it is called once, while writing.
    """

    key: str
    dtype: str
    shape: list[int]
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * ITEM_SIZE[self.dtype]


def header_bytes(specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a file holding `specs` in key order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for spec in sorted(specs, key=lambda s: s.key):
        header[spec.key] = {
            "dtype": spec.dtype,
            "shape": [int(d) for d in spec.shape],
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_streaming(
    path: str | os.PathLike[str],
    specs: Sequence[TensorSpec],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write `specs` to `path` (via a temporary name, then renamed); returns the data bytes.

    Raises `ValueError` for duplicate keys or a produced array whose shape or size does not
    match its spec (the temporary file is removed).
    """
    keys = [s.key for s in specs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate tensor keys in a safetensors file")
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    total = 0
    try:
        with open(tmp, "wb") as f:
            f.write(header_bytes(specs, metadata))
            for spec in sorted(specs, key=lambda s: s.key):
                array = np.ascontiguousarray(spec.produce())
                if list(array.shape) != [int(d) for d in spec.shape] or (
                    array.nbytes != spec.nbytes
                ):
                    raise ValueError(
                        f"{spec.key}: produced {list(array.shape)} {array.dtype}, the header "
                        f"says {spec.shape} {spec.dtype}"
                    )
                f.write(memoryview(array).cast("B"))
                total += array.nbytes
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return total
