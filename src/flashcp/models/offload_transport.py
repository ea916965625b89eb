"""How one tensor of activation offload (`flashcp.models.offload`) goes to the host and back:
the `Transport` protocol and its two implementations, one per device.

* `NumpyTransport` (CPU): the copy is a numpy array, outside Paddle's allocator, so the
  allocator peak (`flashcp.metrics.memory`) drops by exactly what moved; synchronous.
* `PinnedTransport` (GPU): pinned host buffers and one side stream. Out: an event recorded on
  the compute stream after the layer's forward, the side stream waits for it and copies
  `pin_memory(blocking=False)` under `paddle.device.stream_guard`; the device buffer is freed
  once the side stream's "sent" event has completed (polled after each layer, at most
  `offload.MAX_LEAVING` copies in flight). Back: the device buffer is allocated on the compute
  stream (`paddle.empty`), the side stream waits for that point and copies into it
  (`Tensor.copy_(src, blocking=False)`), the compute stream waits for the "arrived" event
  before the layer's backward uses it, and the pinned buffer is freed once that event has
  completed. Paddle sources for each call are cited at `CudaStreams`, the one object that
  makes them (so tests can fake the streams and events).

A transport knows nothing of layers, chains or counters: which tensors move and when is the
offload store's (`flashcp.models.offload`), what a copy is and when it has completed is this.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import paddle

from flashcp.device import on_gpu


class Transport(Protocol):
    """How one tensor goes to the host and back. A copy may complete later (GPU)."""

    def send(self, tensor: paddle.Tensor) -> Any:
        """Start copying `tensor` to the host; returns the host copy's handle."""
        ...

    def sent(self, host: Any, wait: bool = False) -> bool:
        """Whether the copy to the host has completed (the device tensor may be freed);
        `wait` blocks until it has."""
        ...

    def fetch(self, host: Any, shape: list[int], dtype: Any) -> Any:
        """Start copying the host copy back to a new device tensor; returns its handle."""
        ...

    def arrive(self, inbound: Any) -> paddle.Tensor:
        """The device tensor, usable by the compute stream from now on."""
        ...

    def landed(self, inbound: Any, wait: bool = False) -> bool:
        """Whether the copy back has completed (the host copy may be freed); `wait` blocks
        until it has."""
        ...


class NumpyTransport:
    """CPU: copies to numpy arrays, outside Paddle's allocator; every copy is synchronous."""

    def send(self, tensor: paddle.Tensor) -> np.ndarray:
        # Not `Tensor.numpy()`: its array lives in a Paddle tensor (the allocator would count
        # it). A DLPack view (zero-copy; bfloat16 as its uint16 bits, which numpy lacks) copied
        # into numpy's own memory.
        view = tensor.detach()  # shares the buffer; DLPack refuses tensors needing grad
        if view.dtype == paddle.bfloat16:
            view = view.view(paddle.uint16)
        return np.array(np.from_dlpack(view), copy=True)

    def sent(self, host: Any, wait: bool = False) -> bool:
        return True

    def fetch(self, host: Any, shape: list[int], dtype: Any) -> paddle.Tensor:
        # uint16 arrays become bfloat16 tensors (Paddle's own convention), so dtype round-trips
        out = paddle.to_tensor(host)
        if out.dtype != dtype:
            raise RuntimeError(f"offload: a {dtype} tensor came back as {out.dtype}")
        return out

    def arrive(self, inbound: Any) -> paddle.Tensor:
        return inbound

    def landed(self, inbound: Any, wait: bool = False) -> bool:
        return True


class CudaStreams:
    """The Paddle 3.3.1 calls the GPU transport makes (one object, so tests can fake it).

    * `paddle.device.Stream()`, `paddle.device.Event()`, `Event.record(stream)`,
      `Event.query()`, `Event.synchronize()`, `Stream.wait_event(event)`,
      `paddle.device.current_stream()`, `paddle.device.stream_guard(stream)` —
      `paddle/device/__init__.py`. `stream_guard` calls `core._set_current_stream`, which
      swaps the stream of the place's `GPUContext` in the `DeviceContextPool`
      (`paddle/fluid/pybind/cuda_streams_py.cc`, `set_current_stream`), so copies issued inside
      the guard run on the side stream.
    * `Tensor.pin_memory(blocking=False)` — `paddle/base/dygraph/tensor_patch_methods.py`:
      `self._copy_to(core.CUDAPinnedPlace(), blocking)`: a pinned host buffer and an
      asynchronous device → host copy on the current stream's context.
    * `Tensor.copy_(src, blocking=False)` — `paddle/phi/api/lib/tensor_method.cc`,
      `Tensor::copy_`: `phi::Copy` on the `DeviceContextPool` context of the (initialised)
      destination's place, reusing its allocation.
    """

    def __init__(self) -> None:
        self.side = paddle.device.Stream()

    def event(self) -> Any:
        return paddle.device.Event()

    def current(self) -> Any:
        return paddle.device.current_stream()

    def guard(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return paddle.device.stream_guard(stream)

    def to_pinned(self, tensor: paddle.Tensor) -> paddle.Tensor:
        return tensor.pin_memory(blocking=False)

    def empty(self, shape: list[int], dtype: Any) -> paddle.Tensor:
        return paddle.empty(shape, dtype=dtype)

    def copy_into(self, dst: paddle.Tensor, src: paddle.Tensor) -> None:
        dst.copy_(src, False)


@dataclass
class _Moving:
    """A copy under way: its destination and the side-stream event that marks its end."""

    tensor: Any
    done: Any


class PinnedTransport:
    """GPU: pinned host buffers, copies on one side stream, ordered by events (see the module
    docstring; `streams` defaults to Paddle's, `CudaStreams`)."""

    def __init__(self, streams: Any = None) -> None:
        self.streams = streams if streams is not None else CudaStreams()

    def _after_compute(self) -> None:
        """Make the side stream wait for what the compute stream has issued so far."""
        s = self.streams
        ready = s.event()
        ready.record(s.current())
        s.side.wait_event(ready)

    def send(self, tensor: paddle.Tensor) -> _Moving:
        s = self.streams
        self._after_compute()  # the layer's forward has written `tensor`
        with s.guard(s.side):
            host = s.to_pinned(tensor)
            done = s.event()
            done.record(s.side)
        return _Moving(host, done)

    def sent(self, host: _Moving, wait: bool = False) -> bool:
        if wait:
            host.done.synchronize()
            return True
        return bool(host.done.query())

    def fetch(self, host: _Moving, shape: list[int], dtype: Any) -> _Moving:
        s = self.streams
        dst = s.empty(shape, dtype)  # allocated in the compute stream's order
        self._after_compute()  # the side stream writes it only after that point
        with s.guard(s.side):
            s.copy_into(dst, host.tensor)
            done = s.event()
            done.record(s.side)
        return _Moving(dst, done)

    def arrive(self, inbound: _Moving) -> paddle.Tensor:
        self.streams.current().wait_event(inbound.done)
        return inbound.tensor

    def landed(self, inbound: _Moving, wait: bool = False) -> bool:
        if wait:
            inbound.done.synchronize()
            return True
        return bool(inbound.done.query())


def default_transport() -> Transport:
    """Pinned memory and a side stream on a GPU, numpy buffers on the CPU."""
    return PinnedTransport() if on_gpu() else NumpyTransport()
