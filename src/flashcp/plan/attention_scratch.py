"""What one layer's attention holds beyond what the layer keeps: the backward's transient
gradients and the GPU kernel's own scratch, the K/V gathered under context parallelism, and
both for chunked attention.

The attention's saved inputs and outputs are part of the layer's saved set
(`flashcp.plan.activations.layer_saved`); these are the bytes that exist only while attention
runs. Unchunked, measured on CPU (`attention_backward_transient`, `CP_KV_UNITS`); on GPU the
buffers FlashAttention's and FlashMask's backward kernels allocate, read from Paddle's sources
(`kernel_backward_scratch`); chunked (`attention.query_chunk` / `kv_chunk`,
`flashcp.attention.allgather_kv_chunked`), the same terms per query chunk and key chunk
(`attention_backward_bytes`, `attention_forward_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashcp.models.config import ModelArgs
from flashcp.plan.counts import Counts, Dtypes


def attention_backward_transient(args: ModelArgs, *, cp: bool) -> Counts:
    """Tensors of the FlashMask backward beyond what the layer keeps, measured on CPU: the
    output gradient, dq and its accumulation ``5·q`` per token, and without CP ``4·kv`` (dk,
    dv and their accumulation). Under CP the K/V terms are full-sequence instead (re-gathered
    K/V, dK/dV partial sums, reduce-scatter chunks: `CP_KV_UNITS` · S · kv, counted apart)."""
    hd = args.head_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    return Counts().add("attention backward", "c", 5 * q + (0 if cp else 4 * kv))


CP_KV_UNITS = 6
"""Full-sequence `[S, kv]` tensors alive in a CP attention backward (measured on CPU, float32:
the re-gathered K and V, the dK/dV partial sums, their per-rank chunks)."""


@dataclass(frozen=True)
class AttentionCost:
    """Bytes one layer's attention backward adds beyond what the layer keeps (`transient`,
    with `scratch` of it the GPU kernel's own buffers) and the sequence-length K/V terms under
    CP (`kv_gather`), see `attention_backward_bytes`."""

    transient: float
    kv_gather: float
    scratch: float = 0.0


def kernel_backward_scratch(args: ModelArgs, dt: Dtypes, rows: int, keys: int) -> float:
    """GPU: the buffers one FlashAttention / FlashMask backward call allocates besides its
    inputs and dQ, dK, dV, over `rows` query rows and `keys` keys — the larger of the two
    kernels an SM80/SM90 card may run (0 on CPU). Read from Paddle's kernels:

    * FA2 (`flashmask_attention_grad`, `FlashAttnGradBaseKernel` in
      paddle/phi/kernels/gpu/flash_attn_grad_kernel.cu, `FlashAttnBwdParamsV2` in
      flash_attn_utils.h): the float32 dQ accumulator `[rows, Hq, d]` and softmax row sums
      `[Hq, rows]`; with grouped KV heads (Hq ≠ Hkv) `dk_tmp` and `dv_tmp` of shape
      `[keys, Hkv, Hq/Hkv, d]` in the compute dtype — dK and dV expanded to every query head,
      summed over each group after the kernel (`kvReduceBatchedForGQA` / `SumKernel`);
    * FA3 and FlashMask v2 (`FlashAttnV3GradBaseKernel` and `FlashMaskV2GradBaseKernel` in
      paddle/phi/kernels/gpu/flash_attn_v3_grad_kernel.cu, over the kernels of
      PaddlePaddle/flash-attention csrc/flashmask_v2): float32 `dq_accum`, `softmax_d` and
      `softmax_lse_log2`, and for grouped KV heads float32 `dk_accum` / `dv_accum`
      `[Hkv, keys, d]` — GQA is folded into the kernel, the accumulators stay at the KV
      heads.

    At GLM-4-9B's 32 query and 2 KV heads the FA2 expansion is 16 KiB per key (1 GiB for a
    65,536-key chunk), FA3's accumulators 2 KiB."""
    if not dt.gpu:
        return 0.0
    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_size
    gqa = hq != hkv
    fa2 = rows * (hq * d + hq) * 4 + (2 * keys * hq * d * dt.c if gqa else 0)
    fa3 = rows * (hq * d + 2 * hq) * 4 + (2 * keys * hkv * d * 4 if gqa else 0)
    return float(max(fa2, fa3))


def attention_backward_bytes(
    args: ModelArgs,
    dt: Dtypes,
    tokens: int,
    keys: int,
    *,
    cp: bool,
    query_chunk: int = 0,
    kv_chunk: int = 0,
) -> AttentionCost:
    """One attention backward over `tokens` local query rows and `keys` global keys (batch
    included), beyond its saved inputs and outputs.

    Unchunked (today, measured on CPU): `attention_backward_transient` per local token, on GPU
    the kernel's own buffers (`kernel_backward_scratch`: the float32 dQ accumulator and
    softmax row sums per local row, and with grouped KV heads dK/dV over all keys expanded to
    the query heads), and under CP `CP_KV_UNITS` full-sequence `[S, kv]` tensors: the
    re-gathered K and V (compute dtype), dK/dV partial sums and their reduce-scatter chunks
    (float32).

    Chunked (`flashcp.attention.allgather_kv_chunked`: `query_chunk` rows, `kv_chunk` global
    keys at a time): K and V are gathered, and dK/dV summed in float32 and reduce-scattered,
    one key chunk at a time (the chunk's K, V and one kernel call's dK, dV in the compute
    dtype, its float32 partial sums and reduce-scatter parts) into the local full-length dK
    and dV `[T, kv]` (compute dtype), allocated when the backward starts; for every key chunk
    the kernel runs over the local queries one query chunk at a time with the GLOBAL output
    and LSE, so the output gradient and dQ stay full-length — dQ in float32 while it sums over
    more than one key chunk, then cast — while the kernel's own scratch (the ``3·q`` of the
    unchunked measure beyond dO and dQ, and on GPU `kernel_backward_scratch` of one query
    chunk against one key chunk) is per call. Without CP, dK/dV stay local (``4·kv`` per
    token, unchunked)."""
    hd = args.head_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    c = dt.c
    if not (query_chunk or kv_chunk):
        transient = attention_backward_transient(args, cp=cp).bytes(dt) * tokens
        gather = keys * kv * (2 * c + (CP_KV_UNITS - 2) * 4) if cp else 0.0
        scratch = kernel_backward_scratch(args, dt, tokens, keys)
        return AttentionCost(transient + scratch, float(gather), scratch)
    rows = min(query_chunk or tokens, tokens)
    span = min(kv_chunk or keys, keys)
    summed = span < keys  # dQ sums over several key chunks: a float32 accumulator, then cast
    full = tokens * q * (c + (4 + c if summed else c))  # dO, dQ (accumulator and its cast)
    scratch = kernel_backward_scratch(args, dt, rows, span)
    transient = max(full, tokens * q * (c + (4 if summed else c)) + rows * 3 * q * c + scratch)
    if not cp:
        transient += tokens * 4 * kv * c
        return AttentionCost(float(transient), 0.0, scratch)
    # the chunk's K, V, one call's dK, dV, the float32 sums and scatter parts; the local dK, dV
    chunk = span * kv * (2 * c + 2 * c + (CP_KV_UNITS - 2) * 4) + 2 * tokens * kv * c
    return AttentionCost(float(transient), float(chunk), scratch)


def attention_forward_bytes(
    args: ModelArgs,
    dt: Dtypes,
    tokens: int,
    keys: int,
    *,
    cp: bool,
    query_chunk: int = 0,
    kv_chunk: int = 0,
) -> float:
    """What one attention forward holds beyond its inputs (q, k, v) and output: under CP the
    gathered K and V (and the all-gather's per-rank parts) of the whole sequence, or chunked
    of one key chunk, plus one query chunk's float32 merge accumulators (output and LSE) and
    one kernel call's output (`flashcp.attention.allgather_kv_chunked`)."""
    hd = args.head_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    c = dt.c
    if not (query_chunk or kv_chunk):
        return float(2 * keys * kv * 2 * c) if cp else 0.0
    rows = min(query_chunk or tokens, tokens)
    span = min(kv_chunk or keys, keys)
    gather = 2 * span * kv * 2 * c if cp else 0
    return float(gather + rows * ((q + args.num_heads) * 4 + q * c))
