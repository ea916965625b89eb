"""What autograd keeps per decoder layer, per token, read from the models' code and checked
against Paddle's allocator on CPU.

Every count is *elements per local token* of one micro-batch, split by the dtype class the
tensor has:

* ``f``: always float32 — RMSNorm's normalised input and its rsqrt, LayerNorm's mean/var, the
  attention LSE, the MoE router (it computes in float32, `flashcp.models.moe`);
* ``res``: the residual stream and norm outputs — float32 always: O1 autocast keeps them
  float32, and with bf16 storage the embedding outputs float32 and norms return their input's
  dtype (`flashcp.models.layers`), so pipeline stages exchange float32 too;
* ``c``: the compute dtype (train.dtype resolved: bf16 on GPU, float32 on CPU) — matmul
  outputs: q/k/v projections, rotated q/k, the attention output, MLP intermediates.

Measured on CPU (paddlepaddle 3.3.1, float32, `host_memory_stat_*`), layer by layer, these are
exact (to the byte, up to the MoE router's per-expert bookkeeping): e.g. a GLM-4 layer keeps
``10·H + 3·q + 3·kv + 4·I`` float32 elements (+ LSE and rsqrt) per token without recompute.
The bf16 classes follow Paddle's O1 rules (matmuls in bf16, norms and reductions in float32)
and are not verified on a GPU here.

Names: H hidden, q = heads·head_dim, kv = kv_heads·head_dim, I intermediate, Hq query heads,
E experts, k experts per token, Im expert intermediate, Is shared-expert intermediate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from flashcp.models.config import ModelArgs
from flashcp.plan.params import layer_parameters


@dataclass
class Counts:
    """Elements per token by dtype class (``f``, ``res``, ``c``), with what each counts."""

    f: float = 0.0
    res: float = 0.0
    c: float = 0.0
    parts: list[tuple[str, str, float]] = field(default_factory=list)

    def add(self, what: str, cls: str, n: float) -> Counts:
        setattr(self, cls, getattr(self, cls) + n)
        self.parts.append((what, cls, n))
        return self

    def bytes(self, dt: Dtypes) -> float:
        """Bytes per token for the dtype sizes `dt`."""
        return self.f * 4 + self.res * dt.res + self.c * dt.c

    def __add__(self, other: Counts) -> Counts:
        out = Counts(self.f, self.res, self.c, [*self.parts])
        for what, cls, n in other.parts:
            out.add(what, cls, n)
        return out


@dataclass(frozen=True)
class Dtypes:
    """Byte sizes: `c` compute dtype, `res` residual stream, `param` parameter storage."""

    c: int
    res: int
    param: int

    @classmethod
    def of(cls, compute: str, param_dtype: str) -> Dtypes:
        c = 2 if compute == "bfloat16" else 4
        p = 2 if param_dtype == "bfloat16" else 4
        return cls(c=c, res=4, param=p)

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


def _attention(args: ModelArgs, counts: Counts) -> None:
    """Self-attention (`flashcp.models.attention`): the q/k/v projection outputs stay alive
    (rotary keeps slices of them), the rotated q/k, v and the output are saved by the FlashMask
    PyLayer (and the output by o_proj), plus the float32 LSE `[Hq]` per token."""
    hd = args.head_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    counts.add("q/k/v projections", "c", q + 2 * kv)
    if not args.uses_learned_positions:
        counts.add("rotated q, k", "c", q + kv)
    counts.add("attention output", "c", q)
    counts.add("attention LSE", "f", args.num_heads)


def layer_saved(args: ModelArgs, index: int, dt: Dtypes) -> Counts:
    """Elements per token decoder layer `index` keeps for backward WITHOUT recompute, including
    its output (the next layer's input); the layer's input is the previous layer's output and
    is not counted again.

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

    gpt = args.arch == "gpt"
    if gpt:
        n.add("input_layernorm: output (matmul input)", "res", h)
        n.add("input_layernorm: mean, variance", "f", 2)
    else:
        norm("input_layernorm", new_input=False, out_saved=True)
    _attention(args, n)
    if args.arch == "glm":
        norm("post_self_attn_layernorm", new_input=True, out_saved=False)
    if gpt:
        norm("post_attention_layernorm", new_input=True, out_saved=True, rms=False)
        n.add("MLP fc_in output, gelu output", "c", 2 * args.intermediate_size)
    else:
        norm("post_attention_layernorm", new_input=True, out_saved=True)
        if args.is_moe_layer(index):
            _moe(args, n)
        else:
            n.add("MLP gate/up, silu, product", "c", 4 * args.intermediate_size)
    if args.arch == "glm":
        norm("post_mlp_layernorm", new_input=True, out_saved=False)
    n.add("layer output", "res", h)
    if dt.autocast:
        n.add("bf16 copies of float32 matmul inputs", "c", h * _float32_matmul_inputs(args, index))
    return n


def _float32_matmul_inputs(args: ModelArgs, index: int) -> float:
    """Matmuls of a layer whose input is a float32 norm output (per token, in rows of H): q, k
    and v; the MLP's first projection(s), or per routed row the expert's gate and up plus the
    router and the shared expert's gate and up."""
    if args.arch == "gpt":
        return 3 + 1
    if args.is_moe_layer(index):
        shared = 2 if args.num_shared_experts else 0
        return 3 + 1 + 2 * args.num_experts_per_tok + shared
    return 3 + (1 if args.arch == "glm" else 2)


def _moe(args: ModelArgs, n: Counts) -> None:
    """`flashcp.models.moe.MoE`, dropless top-k: every token visits k experts, so the routed
    experts together see T·k rows (T·k/E per expert in expectation). Per routed row: the
    gathered input and the float32 weighted output `[H]` each, and the expert's SwiGLU
    intermediates `4·Im`; the shared expert keeps `4·Is` per token; the router keeps its
    float32 scores `[E]` and, per expert visited, the `[k]` selection mask (E·k), plus a few
    `[E]`/`[1]` sums."""
    h, k, e = args.hidden_size, args.num_experts_per_tok, args.num_experts
    n.add("MoE routed rows: gathered input", "res", k * h)
    n.add("MoE routed rows: float32 weighted output", "f", k * h)
    n.add("MoE routed expert SwiGLU intermediates", "c", 4 * k * args.moe_intermediate_size)
    if args.num_shared_experts:
        inter = args.moe_intermediate_size * args.num_shared_experts
        n.add("MoE shared expert SwiGLU intermediates", "c", 4 * inter)
    n.add("MoE router scores, selection masks, sums", "f", e * k + 2 * e + 1)


def lora_saved(args: ModelArgs, index: int, targets: list[str] | None, rank: int) -> Counts:
    """PaddleFormers' `LoRALinear` keeps `x @ lora_A` (`[r]` per row) for the B matmul, per
    adapted linear; an adapted expert sees T·k/E rows in expectation."""
    n = Counts()
    if not targets:
        return n
    patterns = [re.compile(t) for t in targets]
    rows = 0.0
    for spec in layer_parameters(args, index):
        lin = spec.linear
        if lin and spec.name.endswith(".weight") and any(p.fullmatch(lin) for p in patterns):
            expert = ".experts." in lin
            rows += args.num_experts_per_tok / args.num_experts if expert else 1.0
    if rows:
        n.add("LoRA x @ A", "c", rows * rank)
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
    n.add("stage input (not saved)", "res", h)
    if args.arch == "gpt":
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
    return Counts().add("layer output", "res", args.hidden_size)


def refined_extra(args: ModelArgs) -> Counts:
    """`refined` recompute also keeps the attention output and its LSE per layer."""
    n = Counts()
    n.add("attention output (refined)", "c", args.num_heads * args.head_size)
    n.add("attention LSE (refined)", "f", args.num_heads)
    return n


def mlp_backward_transient(args: ModelArgs, index: int) -> Counts:
    """Gradient tensors alive at once while one layer's MLP back-propagates (steady state: the
    parameter gradients already exist), measured per architecture on CPU: GLM-4 fused SwiGLU
    ``2·I − H``, unfused SwiGLU ``2·I + H``, GPT ``I + 2.5·H``, MoE ``3·H + 1.5·Is``."""
    h, i = args.hidden_size, args.intermediate_size
    if args.arch == "gpt":
        n = i + 2.5 * h
    elif args.is_moe_layer(index):
        n = 3 * h + 1.5 * args.moe_intermediate_size * args.num_shared_experts
    elif args.arch == "glm":
        n = 2 * i - h
    else:
        n = 2 * i + h
    return Counts().add("MLP backward: activation gradients", "c", n)


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
    """A recomputed layer's backward also holds the detached input copy and its gradient."""
    return Counts().add("recompute: input copy and its gradient", "res", 2 * args.hidden_size)


def nograd_forward_transient(args: ModelArgs, index: int) -> Counts:
    """Peak tensors of one layer's forward without gradients (recompute's first pass, DPO
    reference pass): the MLP's intermediates (SwiGLU ``4·I``, GELU ``2·I``) or attention's
    ``3·q + 3·kv`` plus the hidden in and out."""
    h, hd = args.hidden_size, args.head_size
    q, kv = args.num_heads * hd, args.num_kv_heads * hd
    if args.arch == "gpt":
        mlp = 2 * args.intermediate_size
    elif args.is_moe_layer(index):
        mlp = 4 * args.moe_intermediate_size * max(args.num_shared_experts, 1) + 2 * h
    else:
        mlp = 4 * args.intermediate_size
    return Counts().add("no-grad forward peak", "c", max(mlp, 3 * q + 3 * kv) + 2 * h)


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
    if args.arch == "gpt":
        n.add("final norm output", "res", h)
        n.add("final norm mean/var", "f", 2)
    else:
        n.add("final norm normalised + output", "res", 2 * h)
        n.add("final norm rsqrt", "f", 1)
    return n
