"""Counted, range-limited reads of safetensors files, and the casts applied on read.

Streaming checkpoint loading (`flashcp.models.hf_load`) must show how many bytes each rank
really reads, so this module reads safetensors itself instead of going through
`safetensors.safe_open`: ``safe_open`` memory-maps the whole file and the bytes it touches are
page faults, which Python cannot count per call (page cache, read-ahead). The format is small,
documented and stable (https://huggingface.co/docs/safetensors, "Format"):

    [8 bytes: N, little-endian u64] [N bytes: JSON header] [data]

The header maps each tensor name to ``{"dtype": "F32"|"BF16"|..., "shape": [...],
"data_offsets": [begin, end]}`` (offsets into the data section, row-major, little-endian),
plus an optional ``"__metadata__"`` string map. `SafetensorsFile` parses the header, validates
every entry against the file size, and reads a tensor's byte range with ``readinto`` straight
into a numpy buffer; every byte read from disk (the 8-byte length, the header, tensor data,
an index file) goes through one `ReadCounter`, so the count is a measurement at the read call,
not a formula. The tests cross-check every value against ``safetensors`` itself.

bfloat16 has no numpy dtype: its raw bits are handled as ``uint16``, which is also how Paddle
exchanges bfloat16 with numpy (``Tensor.numpy()`` / ``set_value``), so a bf16 tensor goes from
the file into a bf16 parameter without a float32 copy. `cast_raw` implements the casts a load
needs: between float32 and bfloat16 (round to nearest even, as Paddle's own cast), from
float16/float64, and integers only to the same integer type.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HEADER_LIMIT = 100 * 1024 * 1024  # the format caps the header at 100 MB

# safetensors dtype code -> numpy dtype of the raw values (bfloat16 as its uint16 bits).
RAW_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")
# storage dtype name (Paddle's, without "paddle.") -> safetensors code
CODE_OF = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


class SafetensorsFormatError(ValueError):
    """A file is not a well-formed safetensors file (names the file and the entry)."""


class CastError(TypeError):
    """A checkpoint dtype cannot be loaded into a tensor of the wanted dtype."""


@dataclass
class ReadCounter:
    """Bytes actually read from checkpoint files, per file and in total."""

    by_file: dict[str, int] = field(default_factory=dict)
    calls: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_file.values())

    def add(self, path: str | os.PathLike[str], nbytes: int) -> None:
        key = str(path)
        self.by_file[key] = self.by_file.get(key, 0) + nbytes
        self.calls += 1

    def read_text(self, path: str | os.PathLike[str]) -> str:
        """A whole (small) file as text, counted: the shard index."""
        data = Path(path).read_bytes()
        self.add(path, len(data))
        return data.decode("utf-8")


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: dtype code, shape, absolute byte range in the file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


class SafetensorsFile:
    """An open safetensors file: header parsed and validated on open, tensors read on demand.

    Use as a context manager. Every read goes through `counter`.
    """

    def __init__(self, path: str | os.PathLike[str], counter: ReadCounter) -> None:
        self.path = Path(path)
        self.counter = counter
        # Unbuffered: each counted readinto is one read of the OS file, no read-ahead buffer
        # pulling in (uncounted) bytes of neighbouring tensors.
        self._fh = open(self.path, "rb", buffering=0)  # noqa: SIM115 (closed by close/__exit__)
        try:
            self.tensors, self.metadata = self._parse_header()
        except BaseException:
            self._fh.close()
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._fh.close()

    def _bad(self, what: str) -> SafetensorsFormatError:
        return SafetensorsFormatError(
            f"{self.path} is not a valid safetensors file: {what} (re-download or re-save it)"
        )

    def _read_exact(self, offset: int, buf: Any) -> None:
        """Fill the writable buffer `buf` from `offset` (counted)."""
        view = memoryview(buf).cast("B")
        self._fh.seek(offset)
        done = 0
        while done < len(view):
            n = self._fh.readinto(view[done:])
            if not n:
                raise self._bad(f"file ends at byte {offset + done}, {len(view) - done} short")
            done += n
        self.counter.add(self.path, done)

    def _parse_header(self) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        size = self.path.stat().st_size
        if size < 8:
            raise self._bad(f"{size} bytes, shorter than the 8-byte header length")
        length_bytes = bytearray(8)
        self._read_exact(0, length_bytes)
        (n,) = struct.unpack("<Q", length_bytes)
        if n > min(HEADER_LIMIT, size - 8):
            raise self._bad(f"header length {n} exceeds the file ({size} bytes) or 100 MB")
        raw = bytearray(n)
        self._read_exact(8, raw)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._bad(f"header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        data_start, data_size = 8 + n, size - 8 - n
        metadata = header.pop("__metadata__", None) or {}
        tensors: dict[str, TensorInfo] = {}
        for key, entry in header.items():
            try:
                code, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
                begin, end = (int(o) for o in entry["data_offsets"])
            except (TypeError, KeyError, ValueError):
                what = f"entry {key!r} lacks dtype/shape/data_offsets: {entry!r}"
                raise self._bad(what) from None
            if code not in RAW_DTYPES:
                raise self._bad(
                    f"tensor {key!r} has dtype {code!r}, which flashcp does not read "
                    f"(it reads {', '.join(RAW_DTYPES)})"
                )
            want = int(np.prod(shape, dtype=np.int64)) * RAW_DTYPES[code].itemsize
            if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_size:
                raise self._bad(f"tensor {key!r} has shape {list(shape)} / offsets outside data")
            if end - begin != want:
                raise self._bad(
                    f"tensor {key!r}: offsets [{begin}, {end}) hold {end - begin} bytes, "
                    f"{code} {list(shape)} needs {want}"
                )
            tensors[key] = TensorInfo(key, code, shape, data_start + begin, data_start + end)
        return tensors, dict(metadata)

    def read(self, key: str) -> np.ndarray:
        """The tensor `key` in its file dtype and shape (bfloat16 as uint16 bits)."""
        info = self.tensors[key]
        out = np.empty(info.shape, RAW_DTYPES[info.dtype])
        if info.nbytes:
            self._read_exact(info.start, out)
        return out


# -------------------------------------------------------------------------------- casts


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact float32 values of bfloat16 bits (uint16)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float32 values, rounded to nearest even (NaN stays a quiet NaN)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (u >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def to_float32(raw: np.ndarray, code: str) -> np.ndarray:
    """float32 values of raw file data of float dtype `code` (exact except from F64)."""
    if code == "BF16":
        return bf16_bits_to_float32(raw)
    if code not in FLOAT_CODES:
        raise CastError(f"{code} is not a float dtype")
    return raw.astype(np.float32)


def cast_raw(raw: np.ndarray, code: str, target: str) -> np.ndarray:
    """Raw file data of dtype `code` as numpy data for a Paddle tensor of dtype `target`.

    bfloat16 targets get uint16 bits. Float targets take any float code: same dtype is a no-op
    (no copy), BF16 → float32 is exact, float32 → bfloat16 rounds to nearest even (F64 and F16
    go through float32). Integer and bool targets take only their own code. Anything else
    raises `CastError`.
    """
    want = CODE_OF.get(target)
    if want is None:
        raise CastError(f"cannot load into a {target} tensor")
    if code == want:
        return raw
    if want not in FLOAT_CODES or code not in FLOAT_CODES:
        raise CastError(f"a {code} tensor cannot be loaded into a {target} tensor")
    values = to_float32(raw, code)
    if want == "BF16":
        return float32_to_bf16_bits(values)
    return values.astype(RAW_DTYPES[want])
