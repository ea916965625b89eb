"""Label log-probabilities from final hidden states without the full `[tokens, vocab]` logits.

The loss of every recipe needs only log p(label) per target token. Materialising the float32
logits of a whole micro-batch first costs `tokens × vocab × 4` bytes per copy, and the
cross-entropy keeps more than one copy (its softmax for backward, then the gradient): at
GLM-4's 151,552-token vocabulary and 16k local tokens that is ~10 GB each.
`chunked_token_logprobs` instead walks the target tokens in chunks of `chunk_tokens` rows:

1. Only the rows with a label (`labels != ignore_index`) are computed at all: they are
   gathered from the flattened hidden states `[T, H]`, and their log-probs scattered back into
   a zero `[T]` vector (ignored tokens get exactly 0 and no gradient, as in the unchunked path).
2. Each chunk runs `logits_fn` (the model's real head: a Linear, the tied embedding matrix or a
   PaddleFormers `LoRALinear`) and the same `token_logprobs` as the unchunked path (on CPU
   float32 logits the numpy log-softmax of `cpu_elementwise`, which turns the logits it owns
   into their gradient in place; elsewhere `F.cross_entropy`), under
   Paddle's reentrant recompute (`paddle.distributed.fleet.utils.recompute`): the first pass
   runs without grad and keeps only the chunk's hidden rows and labels, so its logits die with
   the chunk; backward reruns the chunk with grad (restoring the RNG state and the autocast
   state of the forward) and back-propagates through it into the hidden rows and the head's
   parameters. At most one chunk's logits, softmax and logit gradient exist at a time.

When the head's backward follows its forward at once (`backward_follows`: the step runner says
so for a micro-batch whose backward is the stage's next pass, and the model has no MTP heads)
and the target rows fit one chunk, the recompute is skipped: the chunk's logits and softmax
would be rebuilt at the very start of that backward anyway, next to the same trunk activations,
so keeping them from the forward costs no peak memory and saves one `[rows, H] × [H, V]` GEMM and
one cross-entropy pass (measured: `docs/moe_step.md`). Only the first call inside the context
keeps its graph; any other (a second head, several chunks, a GPipe schedule whose forwards run
ahead of their backwards) recomputes as above. The values are the same ops on the same rows.

Why recompute and not a PyLayer with a hand-written softmax-minus-one-hot backward: the
recompute calls the real head module in both passes, so the head may be a plain Linear, the
tied embedding, a LoRA-wrapped Linear (whose dropout mask is replayed from the saved RNG state)
or bf16-stored weights cast for compute, and its parameter gradients accumulate through
Paddle's own autograd, with nothing re-derived here. The explicit backward would save one
`[chunk, V]` buffer but must re-implement every head variant's weight gradients.

Numerics: per token, the chunked path runs the same matmul row and the same cross-entropy row
as the unchunked one (the per-token values are bitwise equal wherever the BLAS kernel computes a
row the same way for a different row count), and the per-token values are summed by the caller
over the same `[T]` vector; the head weight's gradient is accumulated chunk by chunk instead of
in one GEMM, which changes only the summation order over tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.distributed.fleet.utils import recompute as fleet_recompute

from flashcp.cp.layout import chunk_bounds
from flashcp.models import cpu_elementwise

IGNORE_INDEX = -100
DEFAULT_LOSS_CHUNK_TOKENS = 4096
"""The default of `train.loss_chunk_tokens` (rows of logits computed at once)."""

LogitsFn = Callable[[paddle.Tensor], paddle.Tensor]
"""Hidden states `[..., H]` to float32 logits `[..., V]` (e.g. `LMHead.logits`)."""

_keep_one_chunk: list[bool] = [False]
"""Whether the next single-chunk head call may keep its graph (`backward_follows`)."""


@contextmanager
def backward_follows(enabled: bool = True) -> Iterator[None]:
    """Within: the head's backward runs right after this forward, so the first one-chunk head
    call keeps its logits' graph instead of recomputing it in backward (module docstring)."""
    before = _keep_one_chunk[0]
    _keep_one_chunk[0] = enabled
    try:
        yield
    finally:
        _keep_one_chunk[0] = before


def token_logprobs(
    logits: paddle.Tensor,
    labels: paddle.Tensor,
    ignore_index: int = IGNORE_INDEX,
    *,
    owned: bool = False,
) -> paddle.Tensor:
    """log p(label) per token from logits `[..., V]`, float32 `[...]`; 0 where
    `labels == ignore_index`.

    `owned`: the logits are this call's alone (the head's fresh output, read by nothing
    else). Then float32 CPU logits take the numpy log-softmax (`cpu_elementwise.label_logprobs`:
    the same values, faster, and no softmax buffer: the backward turns the logits into their
    gradient in place); any other logits take Paddle's cross-entropy."""
    if owned and cpu_elementwise.applies(logits):
        return cpu_elementwise.label_logprobs(logits, labels.astype("int64"), ignore_index)
    lp = -F.cross_entropy(
        logits.astype("float32"),
        labels.astype("int64"),
        reduction="none",
        ignore_index=ignore_index,
    )
    if len(lp.shape) == len(labels.shape) + 1:
        lp = lp.squeeze(-1)
    return lp


def check_chunk_tokens(chunk_tokens: Any) -> int:
    """`chunk_tokens` as an int >= 0, else a ValueError naming `train.loss_chunk_tokens`."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int | np.integer):
        raise ValueError(
            f"train.loss_chunk_tokens must be an integer >= 0 (0 = unchunked), got {chunk_tokens!r}"
        )
    if chunk_tokens < 0:
        raise ValueError(
            f"train.loss_chunk_tokens must be >= 0 (0 = unchunked), got {chunk_tokens}"
        )
    return int(chunk_tokens)


def _chunk_logprobs(
    logits_fn: LogitsFn, hidden: paddle.Tensor, labels: paddle.Tensor
) -> paddle.Tensor:
    """log p(label) of `hidden` rows `[n, H]` with labels `[n]` (no ignored label among them)."""
    return token_logprobs(logits_fn(hidden), labels, owned=True)


def chunked_token_logprobs(
    logits_fn: LogitsFn,
    hidden: paddle.Tensor,
    labels: paddle.Tensor,
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
) -> paddle.Tensor:
    """log p(label) per token, float32 with the shape of `labels`, 0 where
    `labels == ignore_index`: `token_logprobs(logits_fn(hidden), labels)` computed over chunks
    of `chunk_tokens` target rows (see the module docstring); `chunk_tokens = 0` is exactly
    that unchunked expression.

    `hidden` is `[*labels.shape, H]`. Differentiable w.r.t. `hidden` and the parameters
    `logits_fn` uses; under `paddle.no_grad()` the chunks simply run one after the other.
    """
    chunk = check_chunk_tokens(chunk_tokens)
    lead = [int(d) for d in labels.shape]
    if len(hidden.shape) != len(lead) + 1 or [int(d) for d in hidden.shape[:-1]] != lead:
        raise ValueError(
            f"hidden states {list(hidden.shape)} must be the labels' shape {lead} plus the "
            "hidden size (one final hidden state per labelled token)"
        )
    if chunk == 0:
        return token_logprobs(logits_fn(hidden), labels, ignore_index, owned=True)
    count = int(np.prod(lead))
    flat_h = hidden.reshape([count, int(hidden.shape[-1])])
    flat_y = labels.reshape([count]).astype("int64")
    rows = np.nonzero(flat_y.numpy() != ignore_index)[0].astype(np.int64)
    record = paddle.is_grad_enabled()
    run = partial(_chunk_logprobs, logits_fn)
    bounds = chunk_bounds(len(rows), chunk)
    keep = record and len(bounds) == 1 and _keep_one_chunk[0]
    _keep_one_chunk[0] = _keep_one_chunk[0] and not keep  # one kept chunk per context
    parts = []
    for start, stop in bounds:
        index = paddle.to_tensor(rows[start:stop], place=flat_h.place)
        h = paddle.gather(flat_h, index)
        y = paddle.gather(flat_y, index)
        if not record or keep:
            parts.append(run(h, y))
            continue
        if h.stop_gradient:  # a frozen trunk: the head's own parameters still get gradients
            h = h.detach()
            h.stop_gradient = False
        parts.append(fleet_recompute(run, h, y, use_reentrant=True, preserve_rng_state=True))
    all_rows = paddle.to_tensor(rows, place=flat_h.place)
    if not parts:  # no target token: zeros, still attached to `hidden` like the unchunked path
        parts.append(paddle.gather(flat_h, all_rows).astype("float32").sum(-1))
    values = paddle.concat(parts) if len(parts) > 1 else parts[0]
    out = paddle.scatter(paddle.zeros([count], dtype="float32"), all_rows, values)
    return out.reshape(lead)


@dataclass(frozen=True)
class HeadInput:
    """What the last pipeline stage (or a whole `CausalLM`) hands to a loss: its final-norm
    hidden states `[B, L_local, H]` and the module whose LM head applies to them (an
    `LMHead`: `logits(hidden)`, `token_logprobs(hidden, labels, ...)`).

    The runner builds one per micro-batch; recipes call `token_logprobs` (chunked, no full
    logits) and tests may call `logits()` (the full float32 `[B, L_local, V]`).
    """

    hidden: paddle.Tensor
    head: Any

    def logits(self) -> paddle.Tensor:
        """The full float32 logits `[B, L_local, V]` (small vocabularies, tests)."""
        return self.head.logits(self.hidden)

    def token_logprobs(
        self,
        labels: paddle.Tensor,
        *,
        chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
        ignore_index: int = IGNORE_INDEX,
    ) -> paddle.Tensor:
        """log p(label) per token `[B, L_local]` (0 on ignored labels), chunked over tokens."""
        return self.head.token_logprobs(
            self.hidden, labels, chunk_tokens=chunk_tokens, ignore_index=ignore_index
        )

    def mtp_token_logprobs(
        self,
        ids: Any,
        labels: Any,
        positions: Any,
        attn: Any,
        *,
        chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ) -> list[paddle.Tensor]:
        """log p(target) `[B, L_local]` per MTP depth (`flashcp.models.mtp`): the head's MTP
        layers on these hidden states, the micro-batch's MTP inputs `ids` and targets `labels`
        `[D, B, L_local]`, its positions and attention context."""
        return self.head.mtp_token_logprobs(
            self.hidden, ids, labels, positions, attn, chunk_tokens=chunk_tokens
        )
