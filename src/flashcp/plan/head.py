"""The ends of the vocabulary: the LM head and loss on the last stage (and the trained MTP
depths' heads), the embedding's gradient on the first — what they hold, and their moments
``forward: loss``, ``backward: head``, the MTP moments and ``backward: embedding``.

The loss takes the final hidden states (`flashcp.models.head`): unchunked, the cross-entropy
keeps its float32 softmax `[T, V]` until backward (on CPU the numpy log-softmax of
`flashcp.models.cpu_elementwise` writes the softmax over the logits instead, so the logits and
a softmax are never both alive, and turns it into the gradient in place); chunked
(`train.loss_chunk_tokens`), one chunk's logits and softmax exist at a time and each chunk's
hidden rows are kept for its recompute. A weight gradient being formed (head, embedding) is
in its storage dtype plus, with bf16 storage, the float32 cast the main_grad hook adds (not
under ZeRO-2, which casts piece by piece).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashcp.plan import activations as act
from flashcp.plan.items import Moments
from flashcp.plan.layer import NO_WORK, LayerSet, Work
from flashcp.plan.setup import Setup
from flashcp.plan.state import StageState


@dataclass(frozen=True)
class InFlight:
    """What the stage's other in-flight micro-batches hold while one of them is at a moment:
    their activations, their MTP depths' activations and (last stage, unchunked) their
    softmax."""

    others: float
    others_mtp: float
    held: float


@dataclass
class HeadPlan:
    """The head, loss and embedding side of one stage (module docstring), bytes."""

    rows: int
    """Rows of one loss chunk (the local tokens, unchunked)."""
    loss_peak: float
    """The loss's peak for one chunk: float32 logits and softmax (or the upcast head)."""
    softmax_kept: int
    """The unchunked softmax kept until backward (0 chunked)."""
    softmax_all: int
    """The main head's and each trained MTP head's kept softmax."""
    head_grad: int
    head_upcast: int
    emb_grad: int
    dx: int
    """The head's input gradient `[T, H]` in the compute dtype, formed beside its weight
    gradient."""
    micro_extra: int
    """What one micro-batch keeps for the head besides the layers: chunked, each chunk's
    gathered hidden rows and log-probs; unchunked, the head weight's compute-dtype copy."""
    mtp_in: float = 0.0
    mtp_own: list[float] = field(default_factory=list)
    """Per trained MTP depth, what a micro-batch keeps for it (input part, block, head)."""
    mtp_head_grad: int = 0
    mtp_emb_grad: int = 0
    worst_mtp: Work = NO_WORK
    """The worst moment of an MTP depth's backward."""

    @property
    def micro_mtp(self) -> int:
        return int(sum(self.mtp_own))


def grad_bytes(state: StageState) -> int:
    """Bytes of a weight gradient element being formed (module docstring)."""
    PT = state.trained_bytes
    return PT + (4 if PT != 4 and not state.zero2 else 0)


def head_plan(s: Setup, state: StageState, layers: LayerSet) -> HeadPlan:
    """The `HeadPlan` of `state`'s stage."""
    args, dt, T = s.args, state.dt, s.tokens
    H, V, specs, last = args.hidden_size, args.vocab_size, state.specs, state.last
    rows = min(s.chunk, T) if s.chunk > 0 else T
    # float32 logits and (GPU: Paddle's cross-entropy) its softmax; a bf16 matmul output is cast
    # to float32 and dropped before the softmax exists. On CPU the numpy log-softmax has no
    # softmax buffer: the logits alone, overwritten by their softmax, then their gradient.
    loss_peak = rows * V * (8 if dt.gpu else 4)
    softmax_kept = 0 if s.chunk > 0 else T * V * 4
    head_trained = any(x.trained and x.name in ("lm_head.weight",) for x in specs) or (
        args.tie_embeddings
        and any(x.trained and x.name == "model.embed_tokens.weight" for x in specs)
    )
    emb_trained = state.first and any(
        x.trained and x.name == "model.embed_tokens.weight" for x in specs
    )
    per = grad_bytes(state)
    # The head matmul's compute-dtype copy of its weight: kept per in-flight micro-batch when
    # unchunked (saved for backward), transient per chunk when chunked.
    head_copy = H * V * dt.c if (last and dt.autocast and dt.c < dt.param) else 0
    if s.chunk > 0:
        loss_peak += head_copy
        # each chunk's gathered hidden rows (saved by its recompute) and the [T] log-probs:
        # the last stage's (the stages before it run no loss)
        extra = T * (H * dt.res + 2 * 4) if last else 0
    else:
        extra = head_copy
    # bf16 storage, float32 compute: the head's upcast weight exists while its matmul runs
    # (forward, and again for dx in backward), next to one [rows, V] buffer.
    head_upcast = H * V * 4 if (last and dt.upcast) else 0
    out = HeadPlan(
        rows=rows,
        loss_peak=loss_peak,
        softmax_kept=softmax_kept,
        softmax_all=softmax_kept * (1 + len(layers.mtp)),  # the main head's and each MTP's
        head_grad=H * V * per if head_trained else 0,
        head_upcast=head_upcast,
        emb_grad=V * H * per if emb_trained else 0,
        dx=T * H * dt.c,
        micro_extra=extra,
    )
    _mtp(s, state, layers, out, head_copy)
    out.loss_peak = max(out.loss_peak, rows * V * 4 + head_upcast)
    return out


def _mtp(s: Setup, state: StageState, layers: LayerSet, out: HeadPlan, head_copy: int) -> None:
    """Trained MTP depths (`flashcp.models.mtp`): per micro-batch each keeps its input part
    (`act.mtp_input_saved`), its block (planned as a layer above the stage's, in the model's
    recompute mode), its head's saved tensors (and unchunked its softmax and the head
    weight's compute-dtype copy, as the main head's), and under autocast eh_proj's weight
    copy. They back-propagate before the stage's layers do: an MTP depth's worst moment has
    the stage's layers and final norm all kept, the depths below it and its input part, and
    the main head's gradient of the final hidden states waiting to be added to the MTP
    branch's."""
    args, dt, T, H, V = s.args, state.dt, s.tokens, s.args.hidden_size, s.args.vocab_size
    out.mtp_in = act.mtp_input_saved(args, dt).bytes(dt) * T
    mtp_head = act.mtp_head_saved(args, chunked=s.chunk > 0).bytes(dt) * T
    mtp_head += (0 if s.chunk > 0 else head_copy) + (2 * H * H * dt.c if head_copy else 0)
    out.mtp_own = [out.mtp_in + own + mtp_head for own in layers.mtp_kept]
    # an MTP head's / embedding's weight gradient being formed (trained unless under LoRA)
    names = {x.name for x in state.specs if x.trained}
    for index in layers.mtp:
        p = f"model.layers.{index}"
        if f"{p}.shared_head.head.weight" in names:
            out.mtp_head_grad = H * V * grad_bytes(state)
        if f"{p}.embed_tokens.weight" in names:
            out.mtp_emb_grad = V * H * grad_bytes(state)
    best = NO_WORK
    for j in range(len(layers.mtp)):
        below = sum(out.mtp_own[:j]) + out.mtp_in
        for acts_j, work_j, gather_j, ep_j, _ in layers.mtp_backward[j]:
            cand = Work(below + acts_j, work_j + T * H * 4, gather_j, ep_j)
            if sum(cand) > sum(best):
                best = cand
    out.worst_mtp = best


def loss_moments(
    m: Moments,
    s: Setup,
    state: StageState,
    head: HeadPlan,
    layers: LayerSet,
    fly: InFlight,
    *,
    micro_acts: float,
    stage_kept: int,
    buckets: dict[str, int],
) -> None:
    """The last stage's head and loss moments: ``forward: loss``, ``backward: head`` and,
    with trained MTP depths, theirs (``forward: mtp loss``, ``backward: mtp head``,
    ``backward: mtp layer``, ``backward: mtp embedding``). `buckets`: the ZeRO-2 buckets
    live while the head's (``head``) and the layers' (``layers``) gradients are produced
    (`flashcp.plan.optimizer.backward_buckets`)."""
    V = s.args.vocab_size
    micro_mtp = head.micro_mtp
    m.add(
        "forward: loss",
        **state.live_grads("forward"),
        activations=fly.others + micro_acts,
        mtp_activations=fly.others_mtp,
        logits_loss=fly.held + head.loss_peak,
    )
    m.add(
        "backward: head",
        **state.live_grads("head"),
        activations=fly.others + micro_acts,
        mtp_activations=fly.others_mtp + micro_mtp,
        # the softmax turned gradient in place (chunked: the recomputed chunk's; its re-run
        # forward is the 'forward: loss' peak again), next to the head's weight gradient being
        # formed or (bf16 storage on CPU) the head weight upcast for dx
        logits_loss=fly.held + head.softmax_all - head.softmax_kept + head.rows * V * 4,
        weight_grad_transient=max(head.head_grad, head.head_upcast) + head.dx,
        grad_buckets=buckets["head"],
    )
    if not layers.mtp:
        return
    m.add(
        "forward: mtp loss",  # the last depth's head: every depth's activations kept
        **state.live_grads("forward"),
        activations=fly.others + micro_acts,
        mtp_activations=fly.others_mtp + micro_mtp,
        logits_loss=fly.held + head.softmax_all - head.softmax_kept + head.loss_peak,
    )
    m.add(
        "backward: mtp head",  # its softmax turned gradient, its head's weight gradient
        **state.live_grads("mtp"),
        activations=fly.others + micro_acts,
        mtp_activations=fly.others_mtp + micro_mtp,
        logits_loss=fly.held + head.softmax_all - head.softmax_kept + head.rows * V * 4,
        weight_grad_transient=max(head.mtp_head_grad, head.head_upcast) + head.dx,
        grad_buckets=buckets["layers"],
    )
    worst = head.worst_mtp
    m.add(
        "backward: mtp layer",
        **state.live_grads("mtp"),
        activations=fly.others + stage_kept,
        mtp_activations=fly.others_mtp + worst.acts,
        logits_loss=fly.held,
        layer_working_set=worst.working,
        attention_kv_gather=worst.gather,
        ep_buffers=worst.ep,
        grad_buckets=buckets["layers"],
    )
    if head.mtp_emb_grad:
        m.add(
            "backward: mtp embedding",  # its dense weight gradient being formed
            **state.live_grads("mtp"),
            activations=fly.others + stage_kept,
            mtp_activations=fly.others_mtp + head.mtp_in,
            logits_loss=fly.held,
            weight_grad_transient=head.mtp_emb_grad,
            grad_buckets=buckets["layers"],
        )


def embedding_moment(
    m: Moments, state: StageState, head: HeadPlan, fly: InFlight, buckets: dict[str, int]
) -> None:
    """``backward: embedding`` (first stage, trained embedding): its dense weight gradient
    being formed, every layer freed already."""
    if head.emb_grad:
        m.add(
            "backward: embedding",
            **state.live_grads("embedding"),
            activations=fly.others,
            mtp_activations=fly.others_mtp,
            logits_loss=fly.held,
            weight_grad_transient=head.emb_grad,
            grad_buckets=buckets["embedding"],
        )
