"""The counted safetensors reader returns what `safetensors` itself returns, counts exactly the
bytes it reads, refuses malformed files naming them, and casts as Paddle casts."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file as np_load_file
from safetensors.numpy import save_file as np_save_file
from safetensors.paddle import save_file as pd_save_file

from flashcp.models.safetensors_io import (
    CastError,
    ReadCounter,
    SafetensorsFile,
    SafetensorsFormatError,
    bf16_bits_to_float32,
    cast_raw,
    float32_to_bf16_bits,
    to_float32,
)


def _numpy_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "f64": rng.standard_normal((3, 5)),
        "f32": rng.standard_normal((4, 7)).astype(np.float32),
        "f16": rng.standard_normal(9).astype(np.float16),
        "i64": rng.integers(-(2**40), 2**40, (2, 3)),
        "i32": rng.integers(-100, 100, 6).astype(np.int32),
        "i16": rng.integers(-100, 100, 6).astype(np.int16),
        "i8": rng.integers(-100, 100, 6).astype(np.int8),
        "u8": rng.integers(0, 255, 6).astype(np.uint8),
        "bool": rng.integers(0, 2, 5).astype(bool),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 3), np.float32),
    }


def test_reads_equal_safetensors_and_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    np_save_file(_numpy_tensors(), str(path), metadata={"format": "pt"})
    want = np_load_file(str(path))
    counter = ReadCounter()
    with SafetensorsFile(path, counter) as f:
        header = counter.total
        assert f.metadata == {"format": "pt"} and sorted(f.tensors) == sorted(want)
        (n,) = struct.unpack("<Q", path.read_bytes()[:8])
        assert header == 8 + n  # the length and the header, nothing else yet
        got = f.read("f32")
        np.testing.assert_array_equal(got, want["f32"])
        assert counter.total == header + want["f32"].nbytes
        for key, value in want.items():
            out = f.read(key)
            assert out.dtype == value.dtype and out.shape == value.shape, key
            np.testing.assert_array_equal(out, value, err_msg=key)
    # every byte of the file once, plus the f32 tensor a second time
    assert counter.total == path.stat().st_size + want["f32"].nbytes
    assert counter.by_file == {str(path): counter.total}


def test_bf16_bits_equal_safetensors_paddle(tmp_path: Path) -> None:
    path = tmp_path / "b.safetensors"
    values = paddle.to_tensor(np.random.default_rng(1).standard_normal((5, 6)).astype("float32"))
    pd_save_file({"w": values.astype("bfloat16")}, str(path))
    with SafetensorsFile(path, ReadCounter()) as f:
        bits = f.read("w")
        assert f.tensors["w"].dtype == "BF16" and bits.dtype == np.uint16
    with safe_open(str(path), framework="paddle") as ref:
        t = ref.get_tensor("w")
    np.testing.assert_array_equal(bits, t.numpy())
    np.testing.assert_array_equal(to_float32(bits, "BF16"), t.astype("float32").numpy())


def _with_header(path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "length", "match"),
    [
        (b"", b"", 1 << 40, "header length"),
        (b"{not json", b"", None, "not JSON"),
        ([1, 2], b"", None, "not a JSON object"),
        ({"w": {"dtype": "F32"}}, b"", None, "lacks dtype/shape/data_offsets"),
        ({"w": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}}, b"x", None, "F8"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"abcd", None, "needs 8"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"abcd", None, "outside"),
    ],
)
def test_malformed_files_are_named(tmp_path: Path, header, data, length, match) -> None:
    path = _with_header(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(SafetensorsFormatError, match=match) as info:
        SafetensorsFile(path, ReadCounter())
    assert "bad.safetensors" in str(info.value) and "re-download" in str(info.value)


def test_short_file_and_shrunk_file(tmp_path: Path) -> None:
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    with pytest.raises(SafetensorsFormatError, match="shorter than the 8-byte"):
        SafetensorsFile(tmp_path / "tiny.safetensors", ReadCounter())
    path = tmp_path / "c.safetensors"
    np_save_file({"w": np.ones(100, np.float32)}, str(path))
    with SafetensorsFile(path, ReadCounter()) as f:
        path.write_bytes(path.read_bytes()[:-40])  # truncated after the header was checked
        with pytest.raises(SafetensorsFormatError, match="40 short"):
            f.read("w")


# ------------------------------------------------------------------------------ casts


def _interesting_float32() -> np.ndarray:
    rng = np.random.default_rng(2)
    ties = (np.arange(64, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # exactly halfway
    specials = np.array(
        [0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, -1e-45, 1.0, 65504.0], np.float32
    )
    return np.concatenate([rng.standard_normal(500).astype(np.float32) * 3, ties, specials])


def test_float32_to_bf16_matches_paddle_round_to_nearest_even() -> None:
    values = _interesting_float32()
    want = paddle.to_tensor(values).astype("bfloat16").numpy()
    np.testing.assert_array_equal(float32_to_bf16_bits(values), want)
    np.testing.assert_array_equal(cast_raw(values, "F32", "bfloat16"), want)
    truncated = (values.view(np.uint32) >> 16).astype(np.uint16)
    assert (truncated != want).any()  # a truncating cast would fail the check above
    nan = float32_to_bf16_bits(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(bf16_bits_to_float32(nan)).all()


def test_widening_and_other_casts_match_paddle() -> None:
    bits = float32_to_bf16_bits(_interesting_float32())
    want = paddle.to_tensor(bits).astype("float32").numpy()  # uint16 numpy → bf16 in Paddle
    np.testing.assert_array_equal(cast_raw(bits, "BF16", "float32"), want)
    half = _interesting_float32()[:500].astype(np.float16)
    np.testing.assert_array_equal(
        cast_raw(half, "F16", "bfloat16"),
        paddle.to_tensor(half).astype("bfloat16").numpy(),
    )
    np.testing.assert_array_equal(cast_raw(half, "F16", "float32"), half.astype(np.float32))
    double = np.linspace(-2, 2, 11)
    np.testing.assert_array_equal(cast_raw(double, "F64", "float32"), double.astype(np.float32))
    np.testing.assert_array_equal(  # (the finite, in-range part: float16 overflows at 65520)
        cast_raw(bits[:500], "BF16", "float16"), want[:500].astype(np.float16)
    )
    same = np.arange(4, dtype=np.int64)
    assert cast_raw(same, "I64", "int64") is same and cast_raw(bits, "BF16", "bfloat16") is bits


@pytest.mark.parametrize(
    ("code", "target", "match"),
    [
        ("I32", "float32", "a I32 tensor cannot be loaded into a float32 tensor"),
        ("F32", "int64", "a F32 tensor cannot be loaded into a int64 tensor"),
        ("F32", "complex64", "cannot load into a complex64 tensor"),
    ],
)
def test_uncastable(code: str, target: str, match: str) -> None:
    with pytest.raises(CastError, match=match):
        cast_raw(np.zeros(2, np.float32), code, target)


def test_to_float32_refuses_integers() -> None:
    with pytest.raises(CastError, match="not a float dtype"):
        to_float32(np.zeros(2, np.int32), "I32")
