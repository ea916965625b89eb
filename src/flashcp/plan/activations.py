"""What autograd keeps per decoder layer, per token, read from the models' code and checked
against Paddle's allocator on CPU.

Every count is *elements per local token* of one micro-batch, split by the dtype class the
tensor has:

* ``f``: always float32 — RMSNorm's normalised input and its rsqrt, LayerNorm's mean/var, the
  attention LSE, the MoE router (it computes in float32, `flashcp.models.moe`);
* ``res``: the residual stream and norm outputs — float32 by default: O1 autocast keeps them
  float32, and with bf16 storage the embedding outputs float32 and norms return their input's
  dtype (`flashcp.models.layers`), so pipeline stages exchange float32 too; a bfloat16
  residual stream (`flashcp.plan.features`) makes the whole class bfloat16;
* ``c``: the compute dtype (train.dtype resolved: bf16 on GPU, float32 on CPU) — matmul
  outputs: q/k/v projections, rotated q/k, the attention output, MLP intermediates;
* ``e``: the routed experts' rows (`flashcp.models.experts.GroupedExperts.row_dtype`): the
  grouped matmuls' saved inputs, the dispatched and returned buffers (the all-to-all under
  expert parallelism) and the expert outputs the combine keeps — on CPU the activations' dtype
  (float32), on GPU the stored weights' dtype (train.param_dtype: Paddle's grouped GEMM
  computes in it, so the MoE layer casts its rows before dispatch). LoRA-adapted experts take
  float32 rows (their adapters are float32): their buffers count in ``res``.

int64 tensors (the MoE router's choices and buffer slots) count as two float32 elements.

Measured on CPU (paddlepaddle 3.3.1, float32, `host_memory_stat_*`), layer by layer, these are
exact (to the byte): e.g. a GLM-4 layer keeps ``10·H + 3·q + 3·kv + 4·I`` float32 elements
(+ LSE and rsqrt) per token without recompute. The MoE layer's routed part depends on how
many rows the expert buffer has (`expert_rows`: T·k, plus padding on CPU), which the planner
takes from the expected per-expert load of a uniform router.
The bf16 classes follow Paddle's O1 rules (matmuls in bf16, norms and reductions in float32)
and are not verified on a GPU here.

Names: H hidden, q = heads·head_dim, kv = kv_heads·head_dim, I intermediate, Hq query heads,
E experts, k experts per token, Im expert intermediate, Is shared-expert intermediate, r rows
of the routed-expert buffer per token (`ExpertRows`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from statistics import NormalDist

from flashcp.models.config import ModelArgs
from flashcp.models.expert_layout import CAST_CHUNK_BYTES, capacity_for, cost_chosen_groups
from flashcp.models.families.spec import DenseMLP, MoEMLP
from flashcp.plan.params import ParamSpec, is_adapted, layer_parameters


@dataclass
class Counts:
    """Elements per token by dtype class (``f``, ``res``, ``c``), with what each counts."""

    f: float = 0.0
    res: float = 0.0
    c: float = 0.0
    e: float = 0.0
    b: float = 0.0
    parts: list[tuple[str, str, float]] = field(default_factory=list)

    def add(self, what: str, cls: str, n: float) -> Counts:
        setattr(self, cls, getattr(self, cls) + n)
        self.parts.append((what, cls, n))
        return self

    def bytes(self, dt: Dtypes) -> float:
        """Bytes per token for the dtype sizes `dt`."""
        return (
            self.f * 4 + self.res * dt.res + self.c * dt.c + self.e * dt.experts
            + self.b * dt.boundary
        )  # fmt: skip

    def __add__(self, other: Counts) -> Counts:
        out = Counts(self.f, self.res, self.c, self.e, self.b, [*self.parts])
        for what, cls, n in other.parts:
            out.add(what, cls, n)
        return out


@dataclass(frozen=True)
class Dtypes:
    """Byte sizes: `c` compute dtype, `res` the residual stream inside a layer, `param`
    parameter storage, `experts` the routed experts' rows (class ``e``), `boundary` the
    residual stream between layers (`model.residual_dtype`); `gpu`: the device is a GPU."""

    c: int
    res: int
    param: int
    experts: int = 4
    gpu: bool = False
    boundary: int = 4

    @classmethod
    def of(
        cls, compute: str, param_dtype: str, device: str = "cpu", residual: str = "float32"
    ) -> Dtypes:
        """`residual`: the residual stream's dtype, "float32" (today) or "bfloat16"
        (`flashcp.plan.features`)."""
        c = 2 if compute == "bfloat16" else 4
        p = 2 if param_dtype == "bfloat16" else 4
        gpu = device == "gpu"
        sizes = {"float32": 4, "bfloat16": 2}
        if residual not in sizes:
            raise ValueError(f"residual dtype {residual!r}: use one of {sorted(sizes)}")
        # GPU: Paddle's grouped GEMM computes in the weights' dtype; CPU: batched matmuls on
        # the float32 activations, the weights upcast chunk by chunk. A layer upcasts a
        # bf16 stream on entry: inside it the residual class stays float32.
        return cls(c=c, res=4, param=p, experts=p if gpu else 4, gpu=gpu,
                   boundary=sizes[residual])  # fmt: skip

    @property
    def autocast(self) -> bool:
        """bf16 O1 autocast: matmuls cast their float32 inputs (and float32 weights) to bf16
        and save those copies for backward."""
        return self.c < 4

    @property
    def upcast(self) -> bool:
        """bf16 storage with float32 compute (CPU): each matmul upcasts its weight without
        saving the copy (`flashcp.models.precision.cast_linear`), so copies are transient."""
        return self.param < self.c


@dataclass(frozen=True)
class ExpertRows:
    """The routed experts' buffer of one MoE call, as the planner expects it
    (`flashcp.models.experts.plan_layout`)."""

    per_token: float
    """Buffer rows per token: T·k entries (fewer under a capacity), plus padding on CPU."""
    padded: bool
    """CPU padded groups (padding rows); False: GPU ragged (Paddle's grouped GEMM)."""
    chunk_experts: int
    """Experts whose weights one grouped-matmul chunk takes out of the stack at once (CPU with
    bf16 storage: a copy, upcast to the compute dtype,
    `flashcp.models.expert_layout.CAST_CHUNK_BYTES`); 0 without copies (GPU; CPU weights in
    the rows' dtype)."""
    chunks: int
    """Matmuls per projection (CPU: per chunk, or per expert without a cast; > 1: their
    outputs are concatenated)."""


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
    CPU the cost-chosen padded groups of `flashcp.models.expert_layout.cost_chosen_groups`:
    with weights stored in the rows' dtype each expert is one 2-D matmul on its own slice of the
    stack (no copy, its output one part of many); with bf16 storage each group is cut into
    chunks of at most `CAST_CHUNK_BYTES` of gate/up weights upcast to the compute dtype.

    Under expert parallelism (`ep` > 1) a rank's E/ep experts receive the rows of all ep
    ranks' `tokens`: every ep-th of the expected loads of ``ep · tokens`` tokens over the E
    experts (a uniform router gives them ``tokens · k`` rows in all, as without ep)."""
    loads = expected_loads(args, tokens * ep)[::ep] if ep > 1 else expected_loads(args, tokens)
    if dt.gpu:
        return ExpertRows(sum(loads) / max(tokens, 1), False, 0, 0)
    groups = cost_chosen_groups(loads)
    if dt.param == dt.experts:  # no cast: one 2-D matmul per expert on the stack's own slices
        rows = sum(g.rows for g in groups)  # (`grouped_matmul._ExpertMatmuls`), in parts
        return ExpertRows(rows / max(tokens, 1), True, 0, sum(len(g.experts) for g in groups))
    per_expert = args.hidden_size * 2 * args.moe_intermediate_size * dt.c
    per_chunk = max(1, CAST_CHUNK_BYTES // per_expert)
    rows = sum(g.rows for g in groups)
    largest = max((len(g.experts) for g in groups), default=0)
    chunks = sum(-(-len(g.experts) // per_chunk) for g in groups)
    return ExpertRows(rows / max(tokens, 1), True, min(largest, per_chunk), chunks)


def _attention(args: ModelArgs, counts: Counts, qk_norm: bool = False) -> None:
    """Self-attention (`flashcp.models.attention`): the q/k/v projection outputs stay alive
    (rotary keeps slices of them), the rotated q/k, v and the output are saved by the FlashMask
    PyLayer (and the output by o_proj), plus the float32 LSE `[Hq]` per token. QK-norm (an
    RMSNorm per head of q and k) also keeps its normalised q and k and their rsqrt."""
    hd = args.head_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    counts.add("q/k/v projections", "c", q + 2 * kv)
    if qk_norm:
        counts.add("q/k QK-norm: normalised q, k", "c", q + kv)
        counts.add("q/k QK-norm: rsqrt", "f", args.num_heads + args.num_kv_heads)
    if not args.uses_learned_positions:
        counts.add("rotated q, k", "c", q + kv)
    counts.add("attention output", "c", q)
    counts.add("attention LSE", "f", args.num_heads)


def layer_saved(
    args: ModelArgs,
    index: int,
    dt: Dtypes,
    rows: ExpertRows | None = None,
    ep: int = 1,
    *,
    experts_lora: bool = False,
) -> Counts:
    """Elements per token decoder layer `index` keeps for backward WITHOUT recompute, including
    its output (the next layer's input); the layer's input is the previous layer's output and
    is not counted again. `rows`: the MoE layers' expert buffer (default: T·k rows, unpadded);
    `ep`: the expert-parallel degree (`_moe`); `experts_lora`: LoRA adapts the routed experts
    (float32 rows).

    Norms: RMSNorm keeps its normalised input (`h * rsqrt`, saved by the weight multiply) and
    rsqrt `[1]`; a new input (not the layer input) is also kept, by `pow`. LayerNorm keeps
    mean/var `[2]` and a new input. A norm's output counts when a matmul consumes it (it is
    then saved as the matmul's input), not when it is added to the residual (`add` saves
    nothing). Under bf16 autocast every matmul on a float32 input also saves its bf16 copy.
    """
    h = args.hidden_size
    n = Counts()

    def norm(name: str, *, new_input: bool, out_saved: bool, rms: bool = True) -> None:
        if new_input:
            n.add(f"{name}: input", "res", h)
        if rms:
            n.add(f"{name}: normalised input", "res", h)
            n.add(f"{name}: rsqrt", "f", 1)
        else:
            n.add(f"{name}: mean, variance", "f", 2)
        if out_saved:
            n.add(f"{name}: output (matmul input)", "res", h)

    blocks = args.layer_blocks(index)
    rms = blocks.norm == "rms"
    if not rms:
        n.add("input_layernorm: output (matmul input)", "res", h)
        n.add("input_layernorm: mean, variance", "f", 2)
    else:
        norm("input_layernorm", new_input=False, out_saved=True)
    _attention(args, n, blocks.attention.qk_norm)
    if blocks.sandwich_norms:
        norm("post_self_attn_layernorm", new_input=True, out_saved=False, rms=rms)
    norm("post_attention_layernorm", new_input=True, out_saved=True, rms=rms)
    mlp = blocks.mlp
    if isinstance(mlp, MoEMLP):
        _moe(args, n, rows or _unpadded(args), ep, experts_lora=experts_lora)
    elif mlp.kind == "gelu":
        n.add("MLP fc_in output, gelu output", "c", 2 * mlp.intermediate)
    else:
        n.add("MLP gate/up, silu, product", "c", 4 * mlp.intermediate)
    if blocks.sandwich_norms:
        norm("post_mlp_layernorm", new_input=True, out_saved=False, rms=rms)
    n.add("layer output", "b", h)
    if dt.boundary < dt.res:  # the layer computes on its input upcast (`from_residual`)
        n.add("layer input upcast to float32 (kept by the input norm)", "res", h)
    if dt.autocast:
        n.add("bf16 copies of float32 matmul inputs", "c", h * _float32_matmul_inputs(args, index))
    return n


def _float32_matmul_inputs(args: ModelArgs, index: int) -> float:
    """Autocast matmuls of a layer whose input is a float32 norm output (per token, in rows of
    H): q, k and v; the MLP's first projection(s), or the router and the shared expert's gate
    and up (the routed experts' grouped matmuls are not autocast: they cast their inputs
    themselves, counted in the ``e`` class)."""
    mlp = args.layer_blocks(index).mlp
    if isinstance(mlp, MoEMLP):
        shared = 2 if mlp.shared else 0
        return 3 + 1 + shared
    return 3 + (1 if mlp.kind == "gelu" or mlp.fused else 2)


def _unpadded(args: ModelArgs) -> ExpertRows:
    return ExpertRows(float(args.num_experts_per_tok), False, 0, 0)


def _moe(
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


def _adapted(args: ModelArgs, index: int, targets: list[str] | None) -> list[ParamSpec]:
    """The weights of layer `index` LoRA adapts (linear weights and stacked expert weights)."""
    patterns = [re.compile(t) for t in targets or []]
    return [x for x in layer_parameters(args, index) if patterns and is_adapted(x, patterns)]


def experts_adapted(args: ModelArgs, index: int, targets: list[str] | None) -> bool:
    """Whether LoRA adapts the routed experts of layer `index`."""
    return any(x.stacked for x in _adapted(args, index, targets))


def lora_saved(
    args: ModelArgs,
    index: int,
    targets: list[str] | None,
    rank: int,
    dt: Dtypes | None = None,
    rows: ExpertRows | None = None,
) -> Counts:
    """PaddleFormers' `LoRALinear` keeps `x @ lora_A` (`[r]` per row) for the B matmul, per
    adapted linear. Adapted routed experts (`flashcp.lora.experts`) keep it per buffer
    row and projection, in the activations' dtype; on GPU with bf16 storage the float32
    adapters' grouped GEMMs also keep their float32 inputs (the token and SwiGLU output rows),
    which the bf16 base GEMMs saved only as bf16 copies."""
    n = Counts()
    linear = stacked = 0
    for spec in _adapted(args, index, targets):
        if spec.stacked:
            stacked += 1
        else:
            linear += 1
    if linear:
        n.add("LoRA x @ A", "c", linear * rank)
    if stacked:
        r = (rows or _unpadded(args)).per_token
        n.add("MoE LoRA x @ A per buffer row", "res", stacked * r * rank)
        if dt is not None and dt.experts < 4:
            im = args.moe_intermediate_size
            n.add("MoE LoRA float32 inputs per buffer row", "res", r * (args.hidden_size + im))
    return n


def frozen_input_savings(
    args: ModelArgs, index: int, targets: list[str] | None, dt: Dtypes
) -> Counts:
    """What the first layer does NOT keep when its input takes no gradient (a frozen
    embedding under LoRA) and it runs without recompute: its input norm has nothing to
    differentiate (no normalised input, rsqrt or LayerNorm stats), so the embedding output is
    freed; the q/k projection outputs of non-adapted q_proj/k_proj take no gradient, so rotary
    keeps no slice of them. Returned as positive counts to subtract."""
    h, hd = args.hidden_size, args.head_size
    n = Counts()
    n.add("stage input (not saved)", "b", h)
    if args.family.norm == "layer":
        n.add("input_layernorm mean/var (not saved)", "f", 2)
    else:
        n.add("input_layernorm normalised input (not saved)", "res", h)
        n.add("input_layernorm rsqrt (not saved)", "f", 1)
    if not args.uses_learned_positions:
        patterns = [re.compile(t) for t in targets or []]
        p = f"model.layers.{index}.self_attn"
        if not any(x.fullmatch(f"{p}.q_proj") for x in patterns):
            n.add("q projection (no gradient)", "c", args.num_heads * hd)
        if not any(x.fullmatch(f"{p}.k_proj") for x in patterns):
            n.add("k projection (no gradient)", "c", args.num_kv_heads * hd)
    return n


def layer_output(args: ModelArgs) -> Counts:
    """What a recomputed layer keeps: its output `[H]` (the next layer's input)."""
    return Counts().add("layer output", "b", args.hidden_size)


def refined_extra(args: ModelArgs) -> Counts:
    """`refined` recompute also keeps the attention output and its LSE per layer."""
    n = Counts()
    n.add("attention output (refined)", "c", args.num_heads * args.head_size)
    n.add("attention LSE (refined)", "f", args.num_heads)
    return n


def mlp_backward_transient(args: ModelArgs, index: int) -> Counts:
    """Gradient tensors alive at once while one dense layer's MLP back-propagates (steady
    state: the parameter gradients already exist), measured per architecture on CPU: GLM-4
    fused SwiGLU ``2·I − H``, unfused SwiGLU ``2·I + H``, GPT ``I + 2.5·H``. (MoE layers:
    `moe_backward_bytes`.)"""
    h = args.hidden_size
    mlp = args.layer_blocks(index).mlp
    i = mlp.intermediate
    if isinstance(mlp, DenseMLP) and mlp.kind == "gelu":
        n = i + 2.5 * h
    elif isinstance(mlp, DenseMLP) and mlp.fused:
        n = 2 * i - h
    else:
        n = 2 * i + h
    return Counts().add("MLP backward: activation gradients", "c", n)


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

    * the combine: the output gradient's copy, on CPU its zero-row extension `[T+1, H]`, the
      gathered rows and their weighted copy ``2·R·H``, the row→token index (int64), and the
      rows' gradient in the rows' dtype when that is narrower (bf16 rows on GPU);
    * the down projection: its input gradient in parts and concatenated ``2·R·Im`` (on GPU
      the grouped GEMM's ``R·Im`` in the weights' dtype and its float32 cast), the last
      chunk's weight copy (CPU), with adapted experts the adapter branch's pending ``R·H``;
      trained experts add the weight gradient in parts plus the zero tensor it is assembled in
      (CPU; GPU: the gradient, `zeros_like` and the masked copy), or with bf16 storage the
      float32 cast `main_grad` accumulates, whichever is larger;
    * the gate/up projection: likewise, by when the expert output, SwiGLU output and the
      gate/up output are freed (``R·(H + Im)`` less);
    * the shared expert's SwiGLU backward ``2·Is + H`` (as a dense unfused MLP).

    Under expert parallelism (`ep`) the weight gradients are those of the E/ep experts held.
    """
    h, im, T = args.hidden_size, args.moe_intermediate_size, tokens
    R = rows.per_token * T
    f = 4
    c = dt.c
    p = dt.param
    w_down = args.num_experts // ep * im * h
    w_gu = 2 * w_down

    def weight_grad(w: int) -> float:
        if not experts_trained:
            return 0.0
        formed = (3 if dt.gpu else 2) * w * p
        return max(formed, w * (p + 4) if p < 4 else 0)

    def chunk(k_dim: int, n_dim: int) -> float:
        return rows.chunk_experts * k_dim * n_dim * c

    row = 4 if lora_experts else dt.experts
    combine = T * h * f + (T * h * f if rows.padded else 0) + 2 * R * h * f + 2 * R * 4
    combine += R * h * row if row < f else 0
    # GPU: the grouped GEMM's dx in the weights' dtype and its float32 cast, the output
    # gradient cast to the weights' dtype; CPU: dx in parts and concatenated, a weight chunk
    down = R * im * (p + f) + R * h * p if dt.gpu else 2 * R * im * f + chunk(im, h)
    down += (R * h * f if lora_experts else 0) + weight_grad(w_down)
    gate_up = R * (h - im) * f + chunk(h, 2 * im) + weight_grad(w_gu)
    shared = 0.0
    if args.num_shared_experts:
        shared = T * (2 * im * args.num_shared_experts + h) * c
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


def attention_part(saved: Counts) -> Counts:
    """The part of a layer's saved set the attention backward still needs (the input norm, the
    projections, rotated q/k, the attention output and LSE, LoRA's `x @ A`): everything after
    the attention output is freed by the time the backward reaches attention."""
    keep = ("input_layernorm", "q/k/v", "rotated", "attention ", "LoRA", "bf16 copies")
    out = Counts()
    for what, cls, n in saved.parts:
        if what.startswith(keep):
            out.add(what, cls, n)
    return out


def recompute_replay_extra(args: ModelArgs) -> Counts:
    """A recomputed layer's backward also holds the detached input copy (in the stream's
    dtype) and its gradient (computed in float32 inside the layer)."""
    n = Counts().add("recompute: input copy", "b", args.hidden_size)
    return n.add("recompute: input gradient", "res", args.hidden_size)


def nograd_forward_transient(
    args: ModelArgs, index: int, rows: ExpertRows | None = None
) -> Counts:
    """Peak tensors of one layer's forward without gradients (recompute's first pass, DPO
    reference pass): the MLP's intermediates (SwiGLU ``4·I``, GELU ``2·I``) or attention's
    ``3·q + 3·kv`` plus the hidden in and out. A grouped MoE layer (r buffer rows per token)
    peaks at its gate/up projection — the gathered rows and the gate/up output, in chunk parts
    and concatenated — at the down projection (rows, SwiGLU output, expert output in parts
    and concatenated), or at the combine (expert output, every token's k rows, the sum)."""
    h, hd = args.hidden_size, args.head_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    n = Counts()
    blocks = args.layer_blocks(index)
    if isinstance(blocks.mlp, DenseMLP) and blocks.mlp.kind == "gelu":
        mlp = 2 * args.intermediate_size
    elif blocks.moe is not None:
        rows = rows or _unpadded(args)
        r, im, k = rows.per_token, args.moe_intermediate_size, args.num_experts_per_tok
        parts = 2 if rows.chunks > 1 else 1
        routed = max(
            r * (h + parts * 2 * im),
            r * (h + 3 * im),
            r * (h + im + parts * h),
            r * h + k * h + h,
        )
        routed += 2 * args.num_experts + 7 * k + 1 + 2 * r  # router and dispatch
        if routed < 3 * q + 3 * kv:
            return n.add("no-grad forward peak (attention)", "c", 3 * q + 3 * kv + 2 * h)
        n.add("MoE no-grad forward peak", "res", routed)
        return n.add("hidden in and out", "c", 2 * h)
    else:
        mlp = 4 * args.intermediate_size
    return n.add("no-grad forward peak", "c", max(mlp, 3 * q + 3 * kv) + 2 * h)


def stage_extras(args: ModelArgs) -> Counts:
    """Per micro-batch and stage, besides the layers: the rotary cos/sin tables (float32,
    `rotary_dim` per token) the layers keep."""
    n = Counts()
    if not args.uses_learned_positions:
        n.add("rotary cos/sin tables", "f", args.rotary_dim)
    return n


def final_norm(args: ModelArgs) -> Counts:
    """The last stage's final norm before the LM head: RMSNorm keeps its normalised input and
    output (the head's matmul input), LayerNorm its output and mean/var."""
    h = args.hidden_size
    n = Counts()
    if args.family.norm == "layer":
        n.add("final norm output", "res", h)
        n.add("final norm mean/var", "f", 2)
    else:
        n.add("final norm normalised + output", "res", 2 * h)
        n.add("final norm rsqrt", "f", 1)
    return n


def mtp_input_saved(args: ModelArgs, dt: Dtypes) -> Counts:
    """Per token and trained MTP depth (`flashcp.models.mtp.mtp_block_input`), besides its
    decoder block (`layer_saved` of index num_layers + d): the embedding output `[H]` (float32,
    kept by `enorm`'s pow), `enorm`'s and `hnorm`'s normalised inputs and rsqrt (hnorm's input
    is the final norm's output, or the previous depth's block output, already kept), the
    concat `[2H]` eh_proj saves as its input, and eh_proj's output, the block's input in the
    residual dtype (the block does not count its own input, `layer_saved`). Under bf16
    autocast eh_proj also saves its bf16 input copy."""
    h = args.hidden_size
    n = Counts()
    n.add("MTP embedding output (enorm input)", "res", h)
    n.add("MTP enorm, hnorm: normalised inputs", "res", 2 * h)
    n.add("MTP enorm, hnorm: rsqrt", "f", 2)
    if dt.boundary < dt.res:  # hnorm upcasts the previous depth's bf16 block output
        n.add("MTP hnorm: input upcast to float32", "res", h)
    n.add("MTP eh_proj input (concat)", "res", 2 * h)
    n.add("MTP block input (eh_proj output)", "b", h)
    if dt.autocast:
        n.add("MTP eh_proj: bf16 copy of its input", "c", 2 * h)
    return n


def mtp_head_saved(args: ModelArgs, *, chunked: bool) -> Counts:
    """Per token and trained MTP depth, what its head's loss keeps until backward besides the
    logits (`flashcp.models.mtp.SharedHead` under `flashcp.models.head.chunked_token_logprobs`):
    chunked, each chunk's gathered block-output rows (its recompute's input) and the float32
    log-probs and their scatter `[2]`; unchunked, `shared_head.norm`'s normalised input,
    rsqrt and output (the head matmul's input); the softmax is counted with the logits."""
    h = args.hidden_size
    n = Counts()
    if chunked:
        n.add("MTP head: gathered rows of each chunk", "res", h)
        n.add("MTP head: log-probs", "f", 2)
    else:
        n.add("MTP shared_head.norm: normalised input + output", "res", 2 * h)
        n.add("MTP shared_head.norm: rsqrt", "f", 1)
    return n


# -- sequence tiling and chunked attention (`flashcp.plan.features`) --------------------------

ATTENTION_CORE = ("q/k/v projections", "rotated", "attention output", "attention LSE")
"""The parts of `layer_saved` that belong to the attention core (its inputs and outputs)."""


def attention_core(args: ModelArgs, *, stored: bool = False) -> Counts:
    """What a TILED layer's replay keeps for all its local tokens while it back-propagates:
    the attention's inputs (rotated q and k, and v: the token-wise projections and rotary
    run per tile and leave only these) and its output and LSE (`stored`: kept already by
    refined recompute, `refined_extra`, so not counted again); everything else of the layer
    exists for one tile at a time (`tile_saved`)."""
    hd = args.head_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    n = Counts()
    n.add("attention inputs q, k, v (rotated)", "c", q + 2 * kv)
    if not stored:
        n.add("attention output", "c", q)
        n.add("attention LSE", "f", args.num_heads)
    return n


def tile_saved(saved: Counts) -> Counts:
    """Per token of ONE tile: what the token-wise parts of a layer keep while that tile
    back-propagates — the layer's saved set (`layer_saved`, with LoRA's) without the
    attention core and without the layer output (the tile's output is handed on, not kept);
    with a bf16 stream it includes the tile's own float32 upcast of its input rows."""
    out = Counts()
    for what, cls, n in saved.parts:
        if not what.startswith((*ATTENTION_CORE, "layer output")):
            out.add(what, cls, n)
    return out


def tiled_io(args: ModelArgs, dt: Dtypes, *, mlp: bool) -> Counts:
    """Full-length tensors of a tiled layer's backward besides the attention core: the
    replay's input copy and the input gradient assembled tile by tile; while the token-wise
    `after` block back-propagates (`mlp`) also the incoming gradient of the layer output and
    the attention output's gradient being assembled (the attention's dO, counted by the
    attention's own backward once it runs).

    With a bf16 stream the tiles upcast their own rows (`flashcp.models.base.DecoderLayer`),
    so these gradients are in the stream's dtype, and while `before` back-propagates the input
    gradient is two parts (`after`'s, waiting, and `before`'s, being assembled)."""
    h, q = args.hidden_size, args.num_heads * args.head_size
    if dt.boundary < dt.res:
        n = Counts().add("recompute: input copy", "b", h)
        n.add("tiled: input gradient (after's part; before's part)", "b", h if mlp else 2 * h)
        if mlp:
            n.add("tiled: gradient of the layer output", "b", h)
    else:
        n = recompute_replay_extra(args)
        if mlp:
            n.add("tiled: gradient of the layer output", "res", h)
    if mlp:
        n.add("tiled: gradient of the attention output (dO)", "c", q)
    return n


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
