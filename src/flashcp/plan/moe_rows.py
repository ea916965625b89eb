"""The routed experts' rows: how many a MoE layer's buffer holds per token, what they keep for
backward, and the bytes their backward and their token exchange hold at once.

An MoE layer's routed part is counted in buffer rows, not tokens: ``T·k`` entries, fewer under
a capacity, plus the padding of the CPU's batched matmuls on cast weights
(`flashcp.models.expert_layout.cpu_groups`),
spread over the experts as a uniform router spreads them (`expected_loads`). `expert_rows`
turns that into the `ExpertRows` the other formulas take: rows per token, padded or ragged, and
the chunks the CPU's grouped matmul takes out of the weight stack. From it: what a layer keeps
per row (`moe_saved`, part of `flashcp.plan.activations.layer_saved`), its backward's peak
(`moe_backward_bytes`) and, under expert parallelism, the all-to-all buffers
(`ep_exchange_bytes`). Measured on CPU to the byte per token (`tests/unit/plan/test_memory.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from flashcp.models.config import ModelArgs
from flashcp.models.expert_layout import CAST_CHUNK_BYTES, capacity_for, cpu_groups
from flashcp.plan.counts import Counts, Dtypes


@dataclass(frozen=True)
class ExpertRows:
    """The routed experts' buffer of one MoE call, as the planner expects it
    (`flashcp.models.experts.plan_layout`)."""

    per_token: float
    """Buffer rows per token: T·k entries (fewer under a capacity), plus the padding of CPU
    groups with a cast."""
    padded: bool
    """CPU padded groups (padding rows); False: no padding (GPU ragged, Paddle's grouped GEMM;
    CPU one group per expert)."""
    chunk_experts: int
    """Experts whose weights one grouped-matmul chunk takes out of the stack at once (CPU with
    bf16 storage: a copy, upcast to the compute dtype,
    `flashcp.models.expert_layout.CAST_CHUNK_BYTES`); 0 without copies (GPU; CPU weights in
    the rows' dtype)."""
    chunks: int
    """Batched matmuls per projection (CPU with a cast: per chunk; > 1: their outputs are
    concatenated); 0: one output (GPU; CPU without a cast, each expert's product written in
    place)."""

    def in_place(self, gpu: bool) -> bool:
        """Whether the CPU experts write every product into one output (no cast: no parts,
        no concatenation, the weight gradient assembled in place)."""
        return not gpu and self.chunk_experts == 0


def expected_loads(args: ModelArgs, tokens: int) -> list[int]:
    """Entries per expert of one call of `tokens` tokens, largest first, as a uniform router
    spreads them: the quantiles ``(j + 1/2) / E`` of the normal approximation of each expert's
    Binomial(T·k, 1/E) load, clipped by the capacity (`model.moe_capacity_factor`). A trained,
    skewed router pads more on CPU; on GPU (ragged, no padding) only the total T·k counts."""
    e, k = args.num_experts, args.num_experts_per_tok
    entries = tokens * k
    mean = entries / e
    sd = math.sqrt(entries * (1 / e) * (1 - 1 / e))
    z = NormalDist()
    loads = [max(0, round(mean + sd * z.inv_cdf(1 - (j + 0.5) / e))) for j in range(e)]
    cap = capacity_for(args.moe_capacity_factor, tokens, k, e)
    return [min(c, cap) for c in loads] if cap is not None else loads


def expert_rows(args: ModelArgs, tokens: int, dt: Dtypes, ep: int = 1) -> ExpertRows:
    """The `ExpertRows` of a call of `tokens` tokens (see `expected_loads`): on GPU ragged, on
    CPU the groups of `flashcp.models.expert_layout.cpu_groups`: with weights stored in the
    rows' dtype one group per expert, each one 2-D matmul on its own slice of the stack (no
    copy, no padding, written in place into one output); with bf16 storage the cost-chosen
    padded groups, each cut into chunks of at most `CAST_CHUNK_BYTES` of gate/up weights
    upcast to the compute dtype.

    Under expert parallelism (`ep` > 1) a rank's E/ep experts receive the rows of all ep
    ranks' `tokens`: every ep-th of the expected loads of ``ep · tokens`` tokens over the E
    experts (a uniform router gives them ``tokens · k`` rows in all, as without ep)."""
    loads = expected_loads(args, tokens * ep)[::ep] if ep > 1 else expected_loads(args, tokens)
    if dt.gpu:
        return ExpertRows(sum(loads) / max(tokens, 1), False, 0, 0)
    groups = cpu_groups(loads, per_expert=dt.param == dt.experts)
    if dt.param == dt.experts:  # no cast: one 2-D matmul per expert on the stack's own slices
        rows = sum(g.rows for g in groups)  # (`grouped_matmul._ExpertMatmuls`), no padding,
        return ExpertRows(rows / max(tokens, 1), False, 0, 0)  # one output written in place
    per_expert = args.hidden_size * 2 * args.moe_intermediate_size * dt.c
    per_chunk = max(1, CAST_CHUNK_BYTES // per_expert)
    rows = sum(g.rows for g in groups)
    largest = max((len(g.experts) for g in groups), default=0)
    chunks = sum(-(-len(g.experts) // per_chunk) for g in groups)
    return ExpertRows(rows / max(tokens, 1), True, min(largest, per_chunk), chunks)


def unpadded(args: ModelArgs) -> ExpertRows:
    """T·k rows per token, no padding: the buffer when no layout is given."""
    return ExpertRows(float(args.num_experts_per_tok), False, 0, 0)


def moe_saved(
    args: ModelArgs, n: Counts, rows: ExpertRows, ep: int = 1, *, experts_lora: bool = False
) -> None:
    """`flashcp.models.moe.MoE`, grouped: measured on CPU to the byte per token
    (`tests/unit/plan/test_memory.py`). The router keeps its float32 logits and sigmoid scores
    `[E]`, the chosen experts and (after the dispatch) each entry's buffer slot, int64 `[k]`
    each, the raw, normalised and scaled top-k weights `[k]` and their sum; the buffer's token index
    (int64, one per row). Per buffer row (r per token): the grouped matmuls' inputs — the
    gathered token `[H]` and the SwiGLU output `[Im]` (class ``e``) — and the gate/up output
    `[2·Im]` (widened to float32 for the SwiGLU) and the expert output `[H]`, which the
    combine keeps, in the rows' dtype (class ``e``; ``res`` for LoRA-adapted experts). The
    shared expert keeps `4·Is` per token.

    Under expert parallelism (`ep` > 1, `flashcp.models.expert_parallel`) the r rows per token
    are the ones this rank's experts received (a uniform router: as many as it sent, T·k);
    what the combine keeps is the k rows per token returned by the second all-to-all, not the
    expert output (the layout's `leave` and the all-to-all save nothing), and the int64
    indices are the dispatch's token index `[k]` plus the layout's enter/leave indices `[r]`
    each. The exchange buffers themselves are transient (`ep_exchange_bytes`)."""
    h, k, e = args.hidden_size, args.num_experts_per_tok, args.num_experts
    im, r = args.moe_intermediate_size, rows.per_token
    out = "res" if experts_lora else "e"
    n.add("MoE router logits and scores", "f", 2 * e)
    n.add("MoE routing: choices and slots (int64), top-k weights, their sum", "f", 7 * k + 1)
    if ep > 1:
        n.add("MoE ep: token index per entry, layout indices per row (int64)", "f", 2 * k + 4 * r)
        n.add("MoE routed rows: grouped matmul inputs (token, SwiGLU output)", "e", r * (h + im))
        n.add("MoE routed rows: gate/up output", "res", r * 2 * im)
        n.add("MoE ep: returned rows (combine input)", out, k * h)
    else:
        n.add("MoE buffer: token index per row (int64)", "f", 2 * r)
        n.add("MoE routed rows: grouped matmul inputs (token, SwiGLU output)", "e", r * (h + im))
        n.add("MoE routed rows: gate/up output", "res", r * 2 * im)
        n.add("MoE routed rows: expert output (combine input)", out, r * h)
    if args.num_shared_experts:
        inter = args.moe_intermediate_size * args.num_shared_experts
        n.add("MoE shared expert SwiGLU intermediates", "c", 4 * inter)


def moe_backward_bytes(
    args: ModelArgs,
    dt: Dtypes,
    rows: ExpertRows,
    tokens: int,
    *,
    experts_trained: bool,
    lora_experts: bool,
    ep: int = 1,
) -> float:
    """Bytes an MoE layer's backward adds at its worst moment, beyond what the layer keeps
    (read from `flashcp.models.moe_dispatch` / `experts` / `grouped_matmul` and measured on
    CPU, float32: `tests/unit/plan/test_memory.py`). With r buffer rows per token (R = r·T rows):

    * the combine: the output gradient's copy and, on GPU, with padding rows its zero-row
      extension `[T+1, H]`, the gathered rows and their weighted copy ``2·R·H``, the row→token
      index (int64), and the rows' gradient in the rows' dtype when that is narrower (bf16
      rows); on CPU (float32 rows: numpy bodies, their index and block scratch outside Paddle's
      allocator) the rows' gradient ``R·H`` and the routing weights' ``[T, k]``;
    * the down projection: its input gradient ``R·Im`` (CPU with a cast: in parts and
      concatenated, ``2·R·Im``, and the last chunk's weight copy; on GPU the grouped GEMM's
      ``R·Im`` in the weights' dtype and its float32 cast), with adapted experts the adapter
      branch's pending ``R·H``; trained experts add the weight gradient (CPU without a cast:
      written in place; with a cast: in parts plus the zero tensor it is assembled in; GPU:
      the gradient, `zeros_like` and the masked copy), or with bf16 storage the float32 cast
      `main_grad` accumulates, whichever is larger;
    * the gate/up projection: likewise (its input gradient ``R·H``), by when the expert
      output, SwiGLU output and the gate/up output are freed (``R·(H + Im)`` less);
    * the shared expert's SwiGLU backward (an unfused `flashcp.models.layers.SwiGLU`, measured
      alone on CPU): its gate and up gradients ``2·Is`` per token, or when ``Is < H`` one of
      them and its input gradient ``Is + H`` plus a weight gradient ``H·Is`` before it is
      accumulated.

    Under expert parallelism (`ep`) the weight gradients are those of the E/ep experts held.
    """
    h, im, T = args.hidden_size, args.moe_intermediate_size, tokens
    R = rows.per_token * T
    f = 4
    c = dt.c
    p = dt.param
    w_down = args.num_experts // ep * im * h
    w_gu = 2 * w_down

    in_place = rows.in_place(dt.gpu)

    def weight_grad(w: int) -> float:
        if not experts_trained:
            return 0.0
        formed = (3 if dt.gpu else 1 if in_place else 2) * w * p
        return max(formed, w * (p + 4) if p < 4 else 0)

    def chunk(k_dim: int, n_dim: int) -> float:
        return rows.chunk_experts * k_dim * n_dim * c

    row = 4 if lora_experts else dt.experts
    if dt.gpu:
        combine = T * h * f + (T * h * f if rows.padded else 0) + 2 * R * h * f + 2 * R * 4
        combine += R * h * row if row < f else 0
    else:
        combine = T * h * f + R * h * f + T * args.num_experts_per_tok * f
    # GPU: the grouped GEMM's dx in the weights' dtype and its float32 cast, the output
    # gradient cast to the weights' dtype; CPU: dx (with a cast: in parts and concatenated,
    # and a weight chunk)
    if dt.gpu:
        down = R * im * (p + f) + R * h * p
    else:
        down = (1 if in_place else 2) * R * im * f + chunk(im, h)
    down += (R * h * f if lora_experts else 0) + weight_grad(w_down)
    gate_up = R * ((0 if in_place else h) - im) * f + chunk(h, 2 * im) + weight_grad(w_gu)
    shared = 0.0
    if args.num_shared_experts:
        i_s = im * args.num_shared_experts
        shared = max(2 * i_s * T, (i_s + h) * T + h * i_s) * c
    return max(combine, down, gate_up, shared)


def ep_exchange_bytes(
    args: ModelArgs, dt: Dtypes, tokens: int, ep: int, *, experts_lora: bool = False
) -> float:
    """Bytes one MoE layer's token exchange holds at once beyond what the layer keeps, under
    expert parallelism (`flashcp.models.expert_parallel`, `flashcp.distributed.all_to_all`),
    with a uniform router (every rank sends and receives ``T·k`` rows of H, in the rows' dtype:
    the experts' compute dtype, bf16 for bf16 weights on GPU; float32 for LoRA-adapted experts
    and on CPU): the dispatch all-to-all holds the expert-sorted send buffer and
    what it receives; on gloo (CPU) also the contiguous copies of the send blocks and the
    received blocks before they are concatenated (``4·T·k·H``; NCCL ``2·T·k·H``). The combine
    all-to-all (expert outputs back), and in backward the two reverse exchanges of the
    gradients, hold as much. Under full recompute the forward exchange runs again in the
    layer's backward (twice the traffic, the same bytes at once). 0 without ep."""
    if ep <= 1 or not args.num_experts:
        return 0.0
    buffers = 2 if dt.gpu else 4
    row = dt.res if experts_lora else dt.experts
    return buffers * tokens * args.num_experts_per_tok * args.hidden_size * row
