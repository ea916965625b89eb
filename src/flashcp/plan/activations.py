"""What autograd keeps per decoder layer, per token, read from the models' code and checked
against Paddle's allocator on CPU: a layer's saved set, and what recompute, LoRA, sequence
tiling, a frozen input and the MTP layers change in it.

Every count is *elements per local token* of one micro-batch, by dtype class
(`flashcp.plan.counts`: ``f`` float32, ``res`` the residual stream inside a layer, ``c`` the
compute dtype, ``e`` the routed experts' rows, ``b`` the stream between layers). The routed
experts' part of a MoE layer is counted per buffer row (`flashcp.plan.moe_rows`); the bytes
attention holds only while it runs are `flashcp.plan.attention_scratch`'s.

Measured on CPU (paddlepaddle 3.3.1, float32, `host_memory_stat_*`), layer by layer, these are
exact (to the byte): e.g. a GLM-4 layer keeps ``10·H + 3·q + 3·kv + 4·I`` float32 elements
(+ LSE and rsqrt) per token without recompute. The MoE layer's routed part depends on how
many rows the expert buffer has (`moe_rows.expert_rows`: T·k, plus padding on CPU), which the
planner takes from the expected per-expert load of a uniform router.
The bf16 classes follow Paddle's O1 rules (matmuls in bf16, norms and reductions in float32)
and are not verified on a GPU here.

Names: H hidden, q = heads·head_dim, kv = kv_heads·head_dim, I intermediate, Hq query heads,
E experts, k experts per token, Im expert intermediate, Is shared-expert intermediate, r rows
of the routed-expert buffer per token (`ExpertRows`).
"""

from __future__ import annotations

import re

from flashcp.models.config import ModelArgs
from flashcp.models.families.spec import DenseMLP, MoEMLP
from flashcp.plan.counts import Counts, Dtypes
from flashcp.plan.moe_rows import ExpertRows, moe_saved, unpadded
from flashcp.plan.params import ParamSpec, is_adapted, layer_parameters


def _attention(
    args: ModelArgs, counts: Counts, qk_norm: bool = False, numpy_ops: bool = False
) -> None:
    """Self-attention (`flashcp.models.attention`): the q/k/v projection outputs stay alive
    (rotary keeps slices of them), the rotated q/k, v and the output are saved by the FlashMask
    PyLayer (and the output by o_proj), plus the float32 LSE `[Hq]` per token. QK-norm (an
    RMSNorm per head of q and k) keeps its float32 input (the q/k projections themselves in
    float32, else a float32 copy of them: the bf16 ones are freed), normalised q and k and
    their rsqrt, and rotary keeps slices of its output instead of the projections'. With the
    numpy norm and rotary (`numpy_ops`, CPU float32) q and k before rotary are freed (only v
    of the projections stays, as the kernel's input) and no rsqrt is a Paddle tensor.
    Measured per family with Paddle's ops and with the numpy ones:
    `tests/unit/plan/test_layer.py`."""
    hd = args.head_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    rotary = not args.uses_learned_positions
    if (numpy_ops or qk_norm) and rotary:
        counts.add("v projection", "c", kv)
    else:
        counts.add("q/k/v projections", "c", q + 2 * kv)
    if qk_norm:
        if not numpy_ops and rotary:
            counts.add("q/k QK-norm: input (float32)", "res", q + kv)
        counts.add("q/k QK-norm: normalised q, k", "c", q + kv)
        if not numpy_ops:
            counts.add("q/k QK-norm: rsqrt", "f", args.num_heads + args.num_kv_heads)
            if rotary:
                counts.add("q/k QK-norm: output (rotary keeps slices of it)", "c", q + kv)
    if rotary:
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
    `ep`: the expert-parallel degree (`moe_saved`); `experts_lora`: LoRA adapts the routed experts
    (float32 rows).

    Norms: RMSNorm keeps its normalised input (`h * rsqrt`, saved by the weight multiply) and
    rsqrt `[1]`; a new input (not the layer input) is also kept, by `pow`. LayerNorm keeps
    mean/var `[2]` and a new input. A norm's output counts when a matmul consumes it (it is
    then saved as the matmul's input), not when it is added to the residual (`add` saves
    nothing). Under bf16 autocast every matmul on a float32 input also saves its bf16 copy.
    On CPU float32 (`Dtypes.numpy_elementwise`) RMSNorm keeps only its normalised input (its
    rsqrt is a numpy array), so no input of an RMSNorm is kept: not the layer's input, nor its
    output for the next layer's norm (`layer output`; a stage input or output the pipeline
    holds is counted once per stage, `flashcp.plan.layer.stage_layers`).
    """
    h = args.hidden_size
    n = Counts()

    def norm(name: str, *, new_input: bool, out_saved: bool, rms: bool = True) -> None:
        numpy_norm = dt.numpy_rmsnorm("rms" if rms else "layer")
        if new_input and not numpy_norm:
            n.add(f"{name}: input", "res", h)
        if rms:
            n.add(f"{name}: normalised input", "res", h)
            if not numpy_norm:
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
    _attention(args, n, blocks.attention.qk_norm, numpy_ops=dt.numpy_elementwise)
    if blocks.sandwich_norms:
        norm("post_self_attn_layernorm", new_input=True, out_saved=False, rms=rms)
    norm("post_attention_layernorm", new_input=True, out_saved=True, rms=rms)
    mlp = blocks.mlp
    if isinstance(mlp, MoEMLP):
        moe_saved(args, n, rows or unpadded(args), ep, experts_lora=experts_lora)
    elif mlp.kind == "gelu":
        n.add("MLP fc_in output, gelu output", "c", 2 * mlp.intermediate)
    else:
        n.add("MLP gate/up, silu, product", "c", 4 * mlp.intermediate)
    if blocks.sandwich_norms:
        norm("post_mlp_layernorm", new_input=True, out_saved=False, rms=rms)
    if not dt.numpy_rmsnorm(blocks.norm):  # kept by the next layer's (or the final) norm
        n.add("layer output", "b", h)
    if dt.boundary < dt.res and not dt.numpy_rmsnorm(blocks.norm):  # `from_residual`'s upcast
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
        r = (rows or unpadded(args)).per_token
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
    freed (the numpy RMSNorm keeps none anyway: `stage_layers` plans none); the q/k projection
    outputs of non-adapted q_proj/k_proj take no gradient, so rotary keeps no slice of them —
    with the numpy rotary, which keeps none, a QK-norm keeps no normalised q/k instead.
    Returned as positive counts to subtract (measured: `tests/unit/plan/test_layer.py`)."""
    h, hd = args.hidden_size, args.head_size
    blocks = args.layer_blocks(index)
    numpy_norm = dt.numpy_rmsnorm(blocks.norm)
    n = Counts()
    if not numpy_norm:
        n.add("stage input (not saved)", "b", h)
    if blocks.norm == "layer":
        n.add("input_layernorm mean/var (not saved)", "f", 2)
    else:
        n.add("input_layernorm normalised input (not saved)", "res", h)
        if not numpy_norm:
            n.add("input_layernorm rsqrt (not saved)", "f", 1)
    if args.uses_learned_positions:
        return n
    patterns = [re.compile(t) for t in targets or []]
    p = f"model.layers.{index}.self_attn"
    free_q = not any(x.fullmatch(f"{p}.q_proj") for x in patterns)
    free_k = not any(x.fullmatch(f"{p}.k_proj") for x in patterns)
    numpy_ops, qk_norm = dt.numpy_elementwise, blocks.attention.qk_norm
    what = "QK-norm normalised" if numpy_ops else "projection"
    if free_q and (qk_norm or not numpy_ops):
        n.add(f"q {what} (no gradient)", "c", args.num_heads * hd)
    if free_k and (qk_norm or not numpy_ops):
        n.add(f"k {what} (no gradient)", "c", args.num_kv_heads * hd)
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


def attention_part(saved: Counts) -> Counts:
    """The part of a layer's saved set the attention backward still needs (the input norm, the
    projections, rotated q/k, the attention output and LSE, LoRA's `x @ A`): everything after
    the attention output is freed by the time the backward reaches attention."""
    keep = ("input_layernorm", "q/k/v", "v projection", "q/k QK-norm", "rotated", "attention ",
            "LoRA", "bf16 copies")
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
    args: ModelArgs, index: int, dt: Dtypes, rows: ExpertRows | None = None, *,
    pinned: bool = False,
) -> Counts:
    """Peak tensors of one layer's forward without gradients (recompute's first pass, DPO
    reference pass) besides its input, measured per family on CPU with numpy's and Paddle's
    element-wise ops (`tests/unit/plan/test_forward_peak.py`). The layer drops q, k, v once
    attention ran and each block's intermediates once used (`flashcp.models.base`), so the
    peak is the larger of two moments (`pinned`: refined recompute's first pass, which keeps
    the attention's LSE through the MLP too, `flashcp.models.recompute`):

    * attention: rotated q, k and v, and the kernel's output and LSE (on CPU plus its copies
      of q, k and v, `kernel_input_copies`);
    * the MLP: the attention output, the residual sum and the MLP's normalised input, plus
      the MLP's own peak — SwiGLU ``4·I`` (gate, up, silu, product), GELU ``max(2·I, I + H)``;
      a MoE layer the routing and dispatch state ``5·k + E + 2·r`` (and the relaid dispatch
      ``2·k + 2·r`` with padding rows) and the largest of the routed experts (the buffer
      ``r·H`` and ``3·Im`` per row for the gate/up output and SwiGLU, or ``Im + H`` at the
      down projection; with more than one chunk in parts and concatenated), the combine
      (the experts' output and every token's k rows) and the shared expert (the combined
      output and its SwiGLU, ``max(4·Is, Is + H)``).

    A stream narrower than float32 adds the layer's float32 copy of its input, alive
    throughout (`DecoderLayer.forward`'s one upcast)."""
    n = nograd_mlp(args, index, rows, pinned=pinned)
    attention = nograd_attention(args, dt)
    peak = attention if attention.bytes(dt) >= n.bytes(dt) else n
    if dt.boundary < dt.res:
        peak = peak + Counts().add("layer input upcast to float32", "res", args.hidden_size)
    return peak


def nograd_mlp(
    args: ModelArgs, index: int, rows: ExpertRows | None = None, *, pinned: bool = False
) -> Counts:
    """The MLP moment of `nograd_forward_transient` (per token; under tiling per token of
    the tile, with the tile's expert buffer `rows`)."""
    h, q = args.hidden_size, args.num_heads * args.head_size
    held = q + 2 * h  # the attention output, the residual sum, the MLP's normalised input
    blocks = args.layer_blocks(index)
    cls = "c"
    if blocks.moe is not None:
        cls = "res"  # float32 routing state and combine: counted at the residual width
        rows = rows or unpadded(args)
        r, im, k = rows.per_token, args.moe_intermediate_size, args.num_experts_per_tok
        parts = 2 if rows.chunks > 1 else 1
        experts = r * (h + max(parts * 2 * im, 3 * im, im + parts * h))
        combine = r * h + k * h
        shared = args.moe_intermediate_size * args.num_shared_experts
        after = h + max(4 * shared, shared + h) if shared else 0
        state = 5 * k + args.num_experts + 2 * r + (2 * k + 2 * r if rows.padded else 0)
        mlp = held + state + max(experts, combine, after)
    elif isinstance(blocks.mlp, DenseMLP) and blocks.mlp.kind == "gelu":
        i = blocks.mlp.intermediate
        mlp = held + max(2 * i, i + h)
    else:
        mlp = held + 4 * blocks.mlp.intermediate
    n = Counts().add("no-grad forward peak (MLP)", cls, mlp)
    return n.add("attention LSE (pinned)", "f", args.num_heads) if pinned else n


def nograd_attention(args: ModelArgs, dt: Dtypes) -> Counts:
    """The attention moment of `nograd_forward_transient`: rotated q, k and v, the kernel's
    output and LSE, and on CPU the kernel's copies of q, k and v."""
    hd = args.head_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    n = Counts().add("no-grad forward peak (attention)", "c", 2 * q + 2 * kv)
    if not dt.gpu:
        n.add("attention kernel: its copies of q, k, v", "c", kernel_input_copies(args))
    return n.add("attention LSE", "f", args.num_heads)


def kernel_input_copies(args: ModelArgs) -> int:
    """Per token, the Paddle copies of q, k and v the CPU FlashMask kernel holds while it
    runs (`flashcp.kernels.cpu_reference` reads its inputs through `.numpy()`, a copy in
    Paddle's allocator, measured); a GPU FlashAttention / FlashMask forward op allocates only
    its `out` and `softmax_lse`."""
    return (args.num_heads + 2 * args.num_kv_heads) * args.head_size


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
    is the final norm's output, or the previous depth's block output, already kept; LayerNorm
    keeps its input and mean/var instead), the
    concat `[2H]` eh_proj saves as its input, and eh_proj's output, the block's input in the
    residual dtype (the block does not count its own input, `layer_saved`). Under bf16
    autocast eh_proj also saves its bf16 input copy."""
    h = args.hidden_size
    n = Counts()
    if args.family.norm == "layer":  # LayerNorm keeps its input (hnorm's: kept already)
        n.add("MTP embedding output (enorm input)", "res", h)
        n.add("MTP enorm, hnorm: mean/var", "f", 4)
    else:
        numpy_norms = dt.numpy_rmsnorm(args.family.norm)
        if not numpy_norms:  # the numpy RMSNorm keeps no input and no Paddle rsqrt
            n.add("MTP embedding output (enorm input)", "res", h)
        n.add("MTP enorm, hnorm: normalised inputs", "res", 2 * h)
        if not numpy_norms:
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


# -- sequence tiling (`flashcp.plan.features`) -------------------------------------------------

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


