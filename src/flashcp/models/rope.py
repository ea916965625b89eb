"""Rotary inverse frequencies, as transformers computes them (no Paddle): the plain
``base ** (-2i / d)`` table and Llama-3.1's frequency scaling (``rope_type: llama3``), which
divides the long-wavelength frequencies by ``factor``, keeps the short ones and interpolates
between (transformers' ``_compute_llama3_parameters``, 5.3).

Both are float32 like transformers' (its `torch.arange(...).float()` exponent and float32
division), so the tables are bitwise the reference's on every CPU.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from flashcp.models.config import ModelArgs


def inverse_frequencies(rotary_dim: int, base: float) -> np.ndarray:
    """`f_i = base ** (-2i / rotary_dim)`, i < rotary_dim / 2, float32 (HF's formula)."""
    exponent = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / rotary_dim
    return (1.0 / (np.float32(base) ** exponent)).astype(np.float32)


def llama3_scaled(
    inv: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
    original_max_len: int,
) -> np.ndarray:  # fmt: skip
    """Llama-3.1's scaling of the inverse frequencies `inv` (float32): wavelengths longer
    than ``original / low_freq_factor`` slowed by `factor`, shorter than
    ``original / high_freq_factor`` kept, the band between interpolated smoothly."""
    inv = inv.astype(np.float32)
    low_wavelen = original_max_len / low_freq_factor
    high_wavelen = original_max_len / high_freq_factor
    wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor))
    smooth = smooth.astype(np.float32)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def model_inverse_frequencies(args: ModelArgs) -> np.ndarray:
    """The inverse frequencies of `args`' rotary embedding (its `rope_scaling` applied)."""
    inv = inverse_frequencies(args.rotary_dim, args.rotary_base)
    if args.rope_scaling == "llama3":
        inv = llama3_scaled(
            inv, args.rope_factor, args.rope_low_freq_factor, args.rope_high_freq_factor,
            args.rope_original_max_len,
        )  # fmt: skip
    return inv
