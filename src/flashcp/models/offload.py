"""Activation offload (`train.offload_activations`): what a recomputed layer keeps for its
backward lives in host memory between the layer's forward and its backward.

Under recompute (`model.recompute: full` or `refined`, `flashcp.models.recompute`) each decoder
layer keeps, from its forward to its backward:

* its INPUT `[B, L, H]` in `model.residual_dtype` — Paddle's reentrant recompute
  (`paddle.distributed.fleet.recompute.recompute.RecomputeFunction.forward`) saves it with
  `ctx.save_for_backward` after running the layer without gradients. On the first layer of a
  pipeline stage this is the activation the runner received (the runner keeps the same tensor
  for its gradient), on the first stage the embedding output;
* under `refined` also the attention output `[B, L, Hq, D]` (compute dtype) and its LSE
  `[B, Hq, L]` (float32), stored in the layer's `PinnedAttention`s.

Everything else a micro-batch keeps is per micro-batch, not per layer, and stays on the device:
the attention plan (the rebased mask, shared by the layers), the rotary tables, token ids,
positions and labels; on the last stage the final norm's input and the head's saved hidden
states (consumed by the backward that follows at once under 1F1B).

How: `flashcp.models.recompute.checkpoint(fn, h, mode, chain)` runs the recompute inside
Paddle's `paddle.autograd.saved_tensors_hooks` (Paddle 3.3.1,
`paddle/autograd/saved_tensors_hooks.py`: the pack hook is called for every tensor a
`PyLayerContext.save_for_backward` saves, the unpack hook when backward reads it; entering
registers the pair, leaving resets them, so the hooks do not nest). The pack hook hands back a
handle instead of the tensor; once the recompute call has returned (Paddle still reads the
input's place while it builds the node), the layer's tensors are copied to the host and their
device buffers released (`Tensor._clear_data`: every holder of the tensor — the runner's
received input, the caller's reference, and for a frozen embedding output the original the
recompute's detached copy shares its buffer with — sees it freed). Tensors that PyLayers
inside the layer's no-grad forward save (grouped matmuls, the expert all-to-all, bf16-stored
weights' cast-linear) pass through the hooks untouched. The unpack hook,
called when backward reaches the layer, brings the tensors back (waiting for a prefetch
already under way), then starts bringing back the PREVIOUS layer of the same chain, so that
copy overlaps this layer's backward. A chain is one stage forward of one micro-batch
(`ActivationOffloader.chain`, made by `DecoderOps.run_layers`): each handle knows its layer
and each layer its predecessor, so any schedule (1F1B, GPipe, several micro-batches in flight,
backward in any order) finds the right tensors, and a forward whose backward never runs frees
its host copies with its graph.

Transports (what a copy is, and when it has completed: numpy buffers on the CPU, pinned
memory and a side stream on a GPU) are `flashcp.models.offload_transport`.

Memory the planner counts (per rank): host — every offloaded tensor of every micro-batch in
flight (the counters below measure it at the copy); device — the chain's current layer
restored plus the previous layer prefetched during a backward, and on GPU up to
`MAX_LEAVING` layer inputs whose copy out is still running during a forward.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
from paddle.autograd import saved_tensors_hooks

from flashcp.models.offload_transport import Transport, default_transport

MAX_LEAVING = 2
"""GPU: copies to the host allowed in flight before a forward waits for the oldest (bounds the
device memory of layer inputs not yet freed to this many)."""


# ----------------------------------------------------------------------------- counters


@dataclass
class OffloadStats:
    """What moved between device and host (this process), counted at the copies."""

    offloaded_bytes: int = 0
    """Bytes copied device → host."""
    reloaded_bytes: int = 0
    """Bytes copied host → device."""
    tensors: int = 0
    """Tensors copied device → host."""
    host_bytes: int = 0
    """Bytes held on the host now."""
    host_peak_bytes: int = 0
    """The most `host_bytes` has been since the last reset."""


class OffloadCounters:
    """Thread-safe `OffloadStats` of this process (`offload_stats()`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = OffloadStats()

    def moved_out(self, nbytes: int) -> None:
        with self._lock:
            s = self._stats
            s.offloaded_bytes += nbytes
            s.tensors += 1
            s.host_bytes += nbytes
            s.host_peak_bytes = max(s.host_peak_bytes, s.host_bytes)

    def moved_in(self, nbytes: int) -> None:
        with self._lock:
            self._stats.reloaded_bytes += nbytes

    def released(self, nbytes: int) -> None:
        with self._lock:
            self._stats.host_bytes -= nbytes

    def snapshot(self) -> OffloadStats:
        with self._lock:
            return OffloadStats(**vars(self._stats))

    def reset(self) -> None:
        """Zero the totals and restart the host peak from what is held now."""
        with self._lock:
            held = self._stats.host_bytes
            self._stats = OffloadStats(host_bytes=held, host_peak_bytes=held)


COUNTERS = OffloadCounters()


def offload_stats() -> OffloadStats:
    """Bytes this process moved to and from the host, and its host bytes now and at peak."""
    return COUNTERS.snapshot()


def reset_offload_stats() -> None:
    COUNTERS.reset()


def take_host_peak() -> int:
    """The most bytes this process's host copies held since the last call (or reset), then a
    reset: the trainer's per-step `offload/host_peak_gib` (maximised over the ranks)."""
    peak = COUNTERS.snapshot().host_peak_bytes
    COUNTERS.reset()
    return peak


# ------------------------------------------------------------------------ saved tensors


class _HostHold:
    """The host bytes of one copy, released once (explicitly, or when its owner dies)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.held = True
        COUNTERS.moved_out(nbytes)

    def release(self) -> None:
        if self.held:
            self.held = False
            COUNTERS.released(self.nbytes)


class SavedTensor:
    """One tensor a layer keeps: on the device, on its way out, on the host, on its way back."""

    def __init__(self, tensor: paddle.Tensor, *also: paddle.Tensor) -> None:
        self.shape = [int(d) for d in tensor.shape]
        self.dtype = tensor.dtype
        self.stop_gradient = bool(tensor.stop_gradient)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * int(tensor.element_size())
        self.device: paddle.Tensor | None = tensor
        self.sharers = also
        """Tensors sharing the device buffer (a detached input's original): freed with it."""
        self.host: Any = None
        self.hold: _HostHold | None = None
        self.inbound: Any = None

    def send(self, transport: Transport) -> None:
        if self.device is None or self.host is not None:
            raise RuntimeError("offload: a tensor was sent to the host twice")
        self.host = transport.send(self.device)
        self.hold = _HostHold(self.nbytes)
        weakref.finalize(self, self.hold.release)

    def release_device(self) -> None:
        """Free the device buffer (the host copy has arrived)."""
        for t in (self.device, *self.sharers):
            if t is not None and t._is_initialized():
                t._clear_data()
        self.device, self.sharers = None, ()

    def fetch(self, transport: Transport) -> None:
        """Start bringing the host copy back (no-op if on its way or still on the device)."""
        if self.device is not None or self.inbound is not None:
            return
        if self.host is None:
            raise RuntimeError(
                "offload: an activation was read twice in backward (retain_graph) but its host "
                "copy was freed after the first: train without train.offload_activations"
            )
        self.inbound = transport.fetch(self.host, self.shape, self.dtype)
        COUNTERS.moved_in(self.nbytes)

    def take(self, transport: Transport) -> tuple[paddle.Tensor, Any]:
        """The device tensor (this handle forgets it) and what holds the host copy until the
        copy back has landed (None: free now)."""
        if self.device is not None:  # the copy out had not finished: use the original
            tensor, self.device = self.device, None
            transport.sent(self.host, wait=True)
            pending: Any = None
        else:
            if self.inbound is None:
                self.fetch(transport)
            tensor = transport.arrive(self.inbound)
            pending, self.inbound = self.inbound, None
        tensor.stop_gradient = self.stop_gradient
        return tensor, pending

    def free_host(self) -> None:
        self.host = None
        if self.hold is not None:
            self.hold.release()


class _Handle:
    """What the pack hook returns for a layer's input: its `SavedTensor` and layer."""

    def __init__(self, layer: LayerOffload, saved: SavedTensor) -> None:
        self.layer = layer
        self.saved = saved


# --------------------------------------------------------------------------- the store


class LayerOffload:
    """The tensors one recomputed layer of one chain keeps (see `flashcp.models.recompute`)."""

    def __init__(self, chain: OffloadChain, pins: list[Any]) -> None:
        self.chain: OffloadChain | None = chain
        """Until sealed (then the chain points here and this layer only to `prev`)."""
        self.offloader = chain.offloader
        self.prev = chain.last
        self.pins = pins
        """The layer's pinned attention calls (refined: their `out` / `lse` move too)."""
        self.forward_done = False
        """Set when the layer's no-grad forward has returned: only then does a pack hook see
        the recompute's own `save_for_backward` (earlier ones are PyLayers inside the layer)."""
        self.inputs: list[SavedTensor] = []
        self.stored: list[tuple[Any, str, SavedTensor]] = []
        self.sealed = False
        self.restored = False

    # -- forward

    @contextlib.contextmanager
    def hooks(self, original: paddle.Tensor | None = None) -> Iterator[None]:
        """Around the recompute call: its saved input becomes a handle. `original` is the
        caller's tensor when the recompute got a detached copy (sharing its buffer)."""
        sharers = () if original is None else (original,)

        def pack(tensor: paddle.Tensor) -> Any:
            if not self.forward_done:
                return tensor  # a PyLayer inside the layer's forward: not ours
            saved = SavedTensor(tensor, *sharers)
            self.inputs.append(saved)
            return _Handle(self, saved)

        def unpack(packed: Any) -> paddle.Tensor:
            if not isinstance(packed, _Handle):
                return packed
            return packed.layer.restore(packed.saved)

        with saved_tensors_hooks(pack, unpack):
            yield

    def seal(self) -> None:
        """After the recompute call: copy the kept tensors to the host, free what has left."""
        if self.sealed:
            raise RuntimeError("offload: a layer was sealed twice")
        self.sealed = True
        if not self.inputs:
            raise RuntimeError(
                "offload: the recompute saved no input (Paddle's reentrant recompute saves its "
                "tensor inputs with save_for_backward; did the recompute API change?)"
            )
        for pin in self.pins:
            for name in ("out", "lse"):
                tensor = getattr(pin, name, None)
                if tensor is not None:
                    self.stored.append((pin, name, SavedTensor(tensor)))
                    setattr(pin, name, None)
        for saved in self._all():
            saved.send(self.offloader.transport)
            self.offloader.leaving.append(saved)
        if self.chain is not None:
            self.chain.last, self.chain = self, None
        self.offloader.poll()

    def _all(self) -> list[SavedTensor]:
        return [*self.inputs, *(saved for _, _, saved in self.stored)]

    # -- backward

    def prefetch(self) -> None:
        for saved in self._all():
            saved.fetch(self.offloader.transport)

    def restore(self, saved: SavedTensor) -> paddle.Tensor:
        """The unpack hook: this layer's tensors back on the device (the stored attention
        outputs into their pins), then the previous layer's on their way."""
        off = self.offloader
        if not self.restored:
            self.restored = True
            self.prefetch()
            for pin, name, stored in self.stored:
                tensor, pending = stored.take(off.transport)
                setattr(pin, name, tensor)
                off.landing(stored, pending)
        tensor, pending = saved.take(off.transport)
        off.landing(saved, pending)
        if self.prev is not None:
            self.prev.prefetch()
        off.poll()
        return tensor


class OffloadChain:
    """The layers of one stage forward of one micro-batch, in forward order."""

    def __init__(self, offloader: ActivationOffloader) -> None:
        self.offloader = offloader
        self.last: LayerOffload | None = None

    def layer(self, pins: list[Any]) -> LayerOffload:
        return LayerOffload(self, pins)


class ActivationOffloader:
    """This process's offload: its transport and the copies under way (see the module
    docstring). `DecoderOps.run_layers` makes one `chain()` per stage forward."""

    def __init__(self, transport: Transport | None = None) -> None:
        self.transport: Transport = transport if transport is not None else default_transport()
        self.leaving: deque[SavedTensor] = deque()
        """Copies to the host under way (their device tensors not freed yet)."""
        self.returning: deque[tuple[SavedTensor, Any]] = deque()
        """Copies back under way (their host copies not freed yet)."""

    def chain(self) -> OffloadChain:
        return OffloadChain(self)

    def landing(self, saved: SavedTensor, pending: Any) -> None:
        if pending is None:
            saved.free_host()
        else:
            self.returning.append((saved, pending))

    def poll(self) -> None:
        """Free the device copies that have reached the host and the host copies that have
        reached the device; wait for the oldest copy out beyond `MAX_LEAVING` in flight."""
        t = self.transport
        while self.leaving:
            saved = self.leaving[0]
            if saved.device is None:  # taken back before its copy out was polled
                self.leaving.popleft()
                continue
            if not t.sent(saved.host, wait=len(self.leaving) > MAX_LEAVING):
                break
            self.leaving.popleft()
            saved.release_device()
        while self.returning and t.landed(self.returning[0][1]):
            saved, _ = self.returning.popleft()
            saved.free_host()

    def flush(self) -> None:
        """Wait for every copy under way and free what it releases."""
        t = self.transport
        while self.leaving:
            saved = self.leaving.popleft()
            if saved.device is not None:
                t.sent(saved.host, wait=True)
                saved.release_device()
        while self.returning:
            saved, pending = self.returning.popleft()
            t.landed(pending, wait=True)
            saved.free_host()


# ------------------------------------------------------------------------- enabling it


def _stacks(module: Any) -> list[Any]:
    """The decoder stacks (`flashcp.models.base.DecoderOps` hosts: they carry `recompute` and
    `offloader`) of a module: a `CausalLM`'s `model`, or the module itself."""
    return [
        layer
        for layer in module.sublayers(include_self=True)
        if hasattr(layer, "recompute") and hasattr(layer, "offloader")
    ]


def offloader_of(module: Any) -> ActivationOffloader | None:
    """The offloader of a `CausalLM` (or a decoder stack), None when offload is off."""
    for stack in _stacks(module):
        if stack.offloader is not None:
            return stack.offloader
    return None


def apply_activation_offload(
    module: Any, enabled: bool, transport: Transport | None = None
) -> ActivationOffloader | None:
    """Turn `train.offload_activations` on for `module` (a `CausalLM`: the whole model or a
    pipeline stage), after its recompute mode is set (`flashcp.parallelize`); returns its
    offloader (None when `enabled` is false: nothing changes).

    Needs recompute (full or refined): without it autograd keeps every intermediate tensor of
    every layer, which this does not move."""
    if not enabled:
        return None
    stacks = _stacks(module)
    if not stacks:
        raise ValueError(f"{type(module).__name__} has no decoder stack to offload")
    if any(stack.recompute == "none" for stack in stacks):
        raise ValueError(
            "train.offload_activations moves what a RECOMPUTED layer keeps (its input) to the "
            "host, but model.recompute is none: set model.recompute: full (or refined), or "
            "train.offload_activations: false"
        )
    offloader = ActivationOffloader(transport)
    for stack in stacks:
        stack.offloader = offloader
    return offloader


def release_sent(module: Any, tensor: paddle.Tensor) -> None:
    """After a pipeline stage sent its output: free the output's device buffer when offload is
    on (backward only needs its graph node, not its values); keep it otherwise."""
    if offloader_of(module) is not None and tensor._is_initialized():
        tensor._clear_data()
