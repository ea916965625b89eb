"""The gradient side of a step: the ZeRO-2 buckets that live while backward produces the
gradients, and the optimizer step's moments — Paddle's AdamW on the parameters
(``optimizer step``) or, with float32 masters, ``optimizer step: reduce`` and ``optimizer
step: update`` (`flashcp.optim.optimizer`)."""

from __future__ import annotations

from flashcp.plan.items import Moments
from flashcp.plan.setup import Setup
from flashcp.plan.state import StageState


def bucket_bytes(s: Setup, state: StageState) -> int:
    """One gradient bucket: `parallel.grad_bucket_mb`, at least the largest parameter, at
    most every trained gradient (float32)."""
    return min(state.n_trained * 4, max(s.bucket_bytes, state.largest * 4))


def backward_buckets(s: Setup, state: StageState, where: str) -> int:
    """ZeRO-2 (`flashcp.optim.grad_shard`) while backward produces the gradients of `where`
    (``layers``, the LM head ``lm_head``, the embedding ``model.embed_tokens``): the float32
    buffer of the bucket being filled (at most `parallel.grad_bucket_mb`), the float32 piece
    being reduce-scattered (the buffer, or at most a bucket's worth cast from a larger
    parameter's gradient, which never exists whole in float32) with the reduce-scatter's
    temporary (gloo: one piece more; NCCL: its 1/(dp·cp) output), and for the layers the
    parameter's gradient being consumed, in its storage dtype (the head's and the embedding's
    are `weight_grad_transient`). 0 without ZeRO-2."""
    if not state.zero2:
        return 0
    trained = state.trained
    if where == "layers":
        group = [x for x in trained if ".layers." in x.name]
    else:
        group = [x for x in trained if x.name.startswith(where)]
    if not group:
        return 0
    big = max(x.numel for x in group)
    piece = min(s.bucket_bytes, big * 4)
    temp = piece // s.shard_degree if s.device == "gpu" else piece
    filling = min(s.bucket_bytes, sum(x.numel for x in group) * 4)
    consumed = big * state.trained_bytes if where == "layers" else 0
    return filling + piece + temp + consumed


def backward_bucket_set(s: Setup, state: StageState) -> dict[str, int]:
    """`backward_buckets` while the layers', the head's and the embedding's gradients are
    produced (the head is the embedding under tied embeddings)."""
    head = "lm_head" if not s.args.tie_embeddings else "model.embed_tokens"
    return {
        "layers": backward_buckets(s, state, "layers"),
        "head": backward_buckets(s, state, head),
        "embedding": backward_buckets(s, state, "model.embed_tokens"),
    }


def optimizer_moments(m: Moments, s: Setup, state: StageState) -> None:
    """The optimizer step's moments (module docstring)."""
    n_trained, bucket = state.n_trained, bucket_bytes(s, state)
    if not state.master:
        # Paddle's AdamW on the parameters (`flashcp.optim.param_optimizer`): the bucketed
        # all-reduce over cp/dp, the squared-norm temporaries (one parameter at a time), and
        # under pp > 1 the pipeline clip's copy of every gradient (Paddle's own clip, pp = 1,
        # scales in place).
        step_transient = state.largest * 4
        if s.pp > 1 and s.grad_clip > 0:
            step_transient += n_trained * 4
        m.add(
            "optimizer step",
            grad_buckets=bucket if s.dp * s.cp > 1 and n_trained else 0,
            optimizer_step_transient=step_transient,
        )
    elif n_trained:
        # Float32 masters (`MasterOptimizer`): per bucket the float32 gradients are flattened
        # and all-reduced / reduce-scattered (`zero_buffers`) while the parameters' gradients
        # are released; then the shard's gradients (÷ N) are clipped into a scaled copy and
        # AdamW steps the masters; the updated shards are all-gathered per bucket.
        if not state.zero2:  # ZeRO-2 reduced every bucket during backward already
            m.add("optimizer step: reduce", zero_buffers=2 * bucket)
        # The clip replaces the shard's gradients (views of the bucket buffers) one segment at
        # a time, so at most one bucket's old buffer outlives them; the write-back gathers
        # one bucket at a time.
        m.add(
            "optimizer step: update",
            gradients=0,
            main_grads=0,
            grad_shard=0,  # ZeRO-2 hands its shard over (`GradientSharder.take`): the same tensors
            optimizer_step_transient=state.n_state * 4,
            zero_buffers=2 * bucket,
        )
