"""GPU backends on CPU, through fakes: exact op call layouts, the registry table, and the
guarantee that backward runs the version the forward resolved, whatever the flags say later.

Paddle's `_C_ops` functions and the CuTe FA4 entry points are replaced by recorders, so the
positional layouts of reference §1.6 are asserted argument by argument. Where the expected
layouts come from:

* forward ops: the paddlepaddle 3.3.1 wheel's stubs,
  `paddle/_typing/libs/libpaddle/eager/ops/__init__.pyi` - `flash_attn(q, k, v,
  fixed_seed_offset, attn_mask, dropout, causal, return_softmax, is_test, rng_name)`,
  `flashmask_attention(q, k, v, startend_row_indices, fixed_seed_offset, dropout, causal,
  return_softmax, is_test, rng_name)`, `flashmask_attention_v2(q, k, v, startend_row_indices,
  block_mask, softmax_scale, is_causal)`, `flash_attn_v3(q, k, v, q_v_, q_descale_, k_descale_,
  v_descale_, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
  num_splits, manual_set_pack_gqa, pack_gqa_, sm_margin)`;
* grad ops (stubbed as `*args` in the wheel): Paddle's `paddle/phi/ops/yaml/backward.yaml` as
  summarised in ../shared/reference/gpu-path-facts.md - `flashmask_attention_grad(q, k, v,
  startend_row_indices, out, softmax_lse, seed_offset, out_grad, dropout, causal)`,
  `flashmask_attention_v2_grad` with the optional block_mask before out_grad,
  `flash_attn_v3_grad` ending in (softmax_scale, is_causal, window left, window right,
  softcap, sm_margin); `test_op_binding.py` checks every one of these against the real
  binding of the installed Paddle;
* the "group" and "legacy" FA3 variants: reference §1.6 (paddlefleet-cp-and-fa_dispatch.md);
* FA4: PaddlePaddle/flash-attention `flashmask/flash_mask/cute/interface.py` at
  9985af538d20bd7a56c7a5f5ea13294d454a011a - `_flash_attn_fwd(q, k, v, ..., softmax_scale,
  causal, ..., pack_gqa, ..., return_lse, ..., startend_row_indices, ...)` and
  `_flash_attn_bwd(q, k, v, out, dout, lse, flashmask_info, softmax_scale, causal, ...,
  deterministic, ...)` returning `(dq, dk, dv, dsink)` (`CUTE_FWD_PARAMS` / `CUTE_BWD_PARAMS`).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from flashcp import fa_dispatch, mask_families
from flashcp.attention.flashmask import flashmask_attention, flashmask_attention_with_version
from flashcp.kernels import (
    AttentionBackend,
    CpuReferenceBackend,
    FA2Backend,
    FA3Backend,
    FA4Backend,
    fa3,
    registry,
)
from flashcp.kernels.base import default_scale, is_default_scale


class FakeTensor:
    """A stand-in with just a shape, so identity of each argument can be checked."""

    def __init__(self, name: str, shape: tuple[int, ...] = (1, 8, 2, 64)) -> None:
        self.name = name
        self.shape = list(shape)

    def __repr__(self) -> str:
        return f"<{self.name}>"


Q, K, V, IDX, OUT, LSE, DOUT = (FakeTensor(n) for n in ("q", "k", "v", "idx", "out", "lse", "dout"))
DQ, DK, DV, DSINK, SOFTMAX, SEED = (FakeTensor(n) for n in ("dq", "dk", "dv", "dsink", "sm", "so"))


def flag_now() -> str | None:
    """`FLAGS_flash_attn_version` as an op would read it right now (CPU build: environment)."""
    return os.environ.get(fa_dispatch.FLAG_VERSION)


class Recorder:
    """Records every call and the FLAGS_flash_attn_version it saw; returns `result` (or
    `result(*args, **kwargs)` when callable)."""

    def __init__(self, result: Any) -> None:
        self.result = result
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.flags: list[str | None] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        self.flags.append(flag_now())
        return self.result(*args, **kwargs) if callable(self.result) else self.result

    @property
    def only(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        assert len(self.calls) == 1, self.calls
        return self.calls[0]


def same(actual: tuple[Any, ...], expected: tuple[Any, ...]) -> None:
    """Positional args equal: tensors by identity, everything else by value and type."""
    assert len(actual) == len(expected), (actual, expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if isinstance(e, FakeTensor):
            assert a is e, f"arg {i}: {a!r} is not {e!r}"
        else:
            assert type(a) is type(e) and a == e, f"arg {i}: {a!r} != {e!r}"


@pytest.fixture
def ops(monkeypatch: pytest.MonkeyPatch):
    """Replace the FA ops on `paddle._C_ops` with recorders."""
    from paddle import _C_ops

    rec = {
        "flash_attn": Recorder((OUT, SOFTMAX, LSE, SEED)),
        "flash_attn_grad": Recorder((DQ, DK, DV)),
        "flashmask_attention": Recorder((OUT, SOFTMAX, LSE, SEED)),
        "flashmask_attention_grad": Recorder((DQ, DK, DV)),
        "flash_attn_v3": Recorder((OUT, LSE)),
        "flash_attn_v3_grad": Recorder((DQ, DK, DV)),
        "flashmask_attention_v2": Recorder((OUT, LSE)),
        "flashmask_attention_v2_grad": Recorder((DQ, DK, DV)),
    }
    for name, fn in rec.items():
        monkeypatch.setattr(_C_ops, name, fn)
    return rec


@pytest.fixture(autouse=True)
def _clean_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = (fa_dispatch.FLAG_VERSION, fa_dispatch.FLAG_DETERMINISTIC, fa_dispatch.ENV_FA4_POLICY)
    for key in flags:
        monkeypatch.delenv(key, raising=False)


SCALE = 64**-0.5


# ------------------------------------------------------------------------------ FA2


@pytest.mark.parametrize("causal", [False, True])
def test_fa2_flashmask_layout(ops, causal: bool) -> None:
    be = FA2Backend()
    assert be.forward(Q, K, V, IDX, causal=causal, softmax_scale=None) == (OUT, LSE)
    args, kwargs = ops["flashmask_attention"].only
    same(args, (Q, K, V, IDX, None, 0.0, causal, False, False, ""))
    assert kwargs == {}
    assert be.backward(Q, K, V, OUT, LSE, IDX, DOUT, causal=causal, softmax_scale=SCALE) == (
        DQ,
        DK,
        DV,
    )
    args, kwargs = ops["flashmask_attention_grad"].only
    seed = args[6]
    same(args[:6] + args[7:], (Q, K, V, IDX, OUT, LSE, DOUT, 0.0, causal))
    assert kwargs == {}
    # dummy seed/offset: two int64 values on the host (the grad kernel reads them there)
    assert seed.dtype == paddle.int64 and seed.shape == [2] and seed.place.is_cpu_place()
    assert not ops["flash_attn"].calls and not ops["flash_attn_grad"].calls


@pytest.mark.parametrize("causal", [False, True])
def test_fa2_no_mask_layout(ops, causal: bool) -> None:
    be = FA2Backend()
    assert be.forward(Q, K, V, None, causal=causal, softmax_scale=None) == (OUT, LSE)
    same(ops["flash_attn"].only[0], (Q, K, V, None, None, 0.0, causal, False, False, ""))
    be.backward(Q, K, V, OUT, LSE, None, DOUT, causal=causal, softmax_scale=None)
    args, _ = ops["flash_attn_grad"].only
    same(args[:5] + args[6:], (Q, K, V, OUT, LSE, None, DOUT, 0.0, causal))
    assert not ops["flashmask_attention"].calls


def test_fa2_rejects_custom_scale(ops) -> None:
    be = FA2Backend()
    with pytest.raises(NotImplementedError, match="softmax_scale"):
        be.forward(Q, K, V, IDX, causal=True, softmax_scale=0.5)
    with pytest.raises(NotImplementedError, match="softmax_scale"):
        be.backward(Q, K, V, OUT, LSE, IDX, DOUT, causal=True, softmax_scale=0.5)
    assert not ops["flashmask_attention"].calls and not ops["flashmask_attention_grad"].calls
    be.forward(Q, K, V, IDX, causal=True, softmax_scale=SCALE)  # the default value is fine
    assert is_default_scale(None, 64) and not is_default_scale(0.1, 64)


# ------------------------------------------------------------------------------ FA3


def _api_group(query, key, value, startend_row_indices=None, *, block_mask=None, group=None):
    """Stand-in signature of the newest Paddle flashmask_attention (has `group`)."""


def _api_block_mask(query, key, value, startend_row_indices=None, *, block_mask=None):
    """Stand-in signature with `block_mask` (Paddle PR #76729)."""


def _api_legacy(query, key, value, startend_row_indices=None, *, causal=False):
    """Stand-in signature of an older Paddle."""


FA3_LAYOUTS = {
    # variant: (API stand-in, forward args after q, k, v, idx; grad args after q..idx)
    "group": (_api_group, (None, None, "S", "C", 0, 1), (None, DOUT, "S", "C", 0, 1)),
    "block_mask": (_api_block_mask, (None, "S", "C"), (None, DOUT, "S", "C")),
    "legacy": (_api_legacy, ("S", "C"), (DOUT, "S", "C")),
}


def _fill(template: tuple[Any, ...], scale: float, causal: bool) -> tuple[Any, ...]:
    return tuple(scale if a == "S" else causal if a == "C" else a for a in template)


@pytest.mark.parametrize("scale", [None, 0.125])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", sorted(FA3_LAYOUTS))
def test_fa3_flashmask_v2_layouts(ops, monkeypatch, variant: str, causal: bool, scale) -> None:
    api, fwd_tail, grad_tail = FA3_LAYOUTS[variant]
    monkeypatch.setattr(F, "flashmask_attention", api)
    assert fa3.flashmask_v2_variant() == variant
    want_scale = SCALE if scale is None else scale
    be = FA3Backend()
    assert be.forward(Q, K, V, IDX, causal=causal, softmax_scale=scale) == (OUT, LSE)
    args, kwargs = ops["flashmask_attention_v2"].only
    same(args, (Q, K, V, IDX, *_fill(fwd_tail, want_scale, causal)))
    assert kwargs == {} and type(args[(Q, K, V, IDX, *fwd_tail).index("S")]) is float
    assert be.backward(Q, K, V, OUT, LSE, IDX, DOUT, causal=causal, softmax_scale=scale) == (
        DQ,
        DK,
        DV,
    )
    args, kwargs = ops["flashmask_attention_v2_grad"].only
    same(args, (Q, K, V, OUT, LSE, IDX, *_fill(grad_tail, want_scale, causal)))
    assert kwargs == {}


def test_fa3_variant_probe_on_installed_paddle() -> None:
    params = inspect.signature(F.flashmask_attention).parameters
    expect = "group" if "group" in params else "block_mask" if "block_mask" in params else "legacy"
    assert fa3.flashmask_v2_variant() == expect


@pytest.mark.parametrize("causal", [False, True])
def test_fa3_no_mask_layout(ops, causal: bool) -> None:
    be = FA3Backend()
    be.forward(Q, K, V, None, causal=causal, softmax_scale=None)
    args, _ = ops["flash_attn_v3"].only
    same(args, (Q, K, V, None, None, None, None, SCALE, causal, -1, -1, 0.0, 1, False, False, 0))
    be.backward(Q, K, V, OUT, LSE, None, DOUT, causal=causal, softmax_scale=0.25)
    args, _ = ops["flash_attn_v3_grad"].only
    same(args, (Q, K, V, OUT, LSE, DOUT, 0.25, causal, -1, -1, 0.0, 0))
    assert not ops["flashmask_attention_v2"].calls


# ------------------------------------------------------------------------------ FA4


# Parameter names of the upstream CuTe entry points (interface.py @ 9985af5, see the module
# docstring): every keyword the FA4 backend passes must be one of them.
CUTE_FWD_PARAMS = (
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table",
    "softmax_scale", "causal", "softcap", "window_size_left", "window_size_right",
    "learnable_sink", "m_block_size", "n_block_size", "num_threads", "num_splits", "pack_gqa",
    "_compute_capability", "score_mod", "mask_mod", "block_sparse_tensors", "return_lse", "out",
    "lse", "aux_tensors", "startend_row_indices", "block_logit", "block_size", "block_bos",
    "group",
)  # fmt: skip
CUTE_BWD_POSITIONAL = ("q", "k", "v", "out", "dout", "lse", "flashmask_info")
CUTE_BWD_KEYWORDS = ("softmax_scale", "causal", "softcap", "learnable_sink", "deterministic")


class FakeInfo:
    def __init__(self, *, startend_row_indices: Any, is_causal: bool) -> None:
        self.startend_row_indices = startend_row_indices
        self.is_causal = is_causal


@pytest.fixture
def cute(monkeypatch: pytest.MonkeyPatch):
    fwd = Recorder((OUT, LSE))
    bwd = Recorder((DQ, DK, DV, DSINK))  # newer builds: (dq, dk, dv, dsink)
    monkeypatch.setattr(fa_dispatch, "import_cute_fa4", lambda: (fwd, bwd, FakeInfo))
    return fwd, bwd


@pytest.mark.parametrize("causal", [False, True])
def test_fa4_layout(cute, monkeypatch, causal: bool) -> None:
    fwd, bwd = cute
    be = FA4Backend()
    assert be.forward(Q, K, V, IDX, causal=causal, softmax_scale=None) == (OUT, LSE)
    args, kwargs = fwd.only
    same(args, (Q, K, V))
    assert kwargs == {
        "causal": causal,
        "return_lse": True,
        "startend_row_indices": IDX,
        "softmax_scale": SCALE,
        "pack_gqa": False,
    }
    monkeypatch.setenv(fa_dispatch.FLAG_DETERMINISTIC, "1")
    grads = be.backward(Q, K, V, OUT, LSE, IDX, DOUT, causal=causal, softmax_scale=0.5)
    assert grads == (DQ, DK, DV)  # the sink gradient is dropped
    args, kwargs = bwd.only
    same(args[:6], (Q, K, V, OUT, DOUT, LSE))
    info = args[6]  # flashmask_info goes positionally in slot 7
    assert len(args) == len(CUTE_BWD_POSITIONAL) and isinstance(info, FakeInfo)
    assert info.startend_row_indices is IDX and info.is_causal is causal
    assert kwargs == {"softmax_scale": 0.5, "causal": causal, "deterministic": True}
    assert set(kwargs) <= set(CUTE_BWD_KEYWORDS)
    assert set(fwd.only[1]) <= set(CUTE_FWD_PARAMS[3:])  # keywords only after q, k, v


def test_fa4_no_mask_and_three_tuple(cute, monkeypatch) -> None:
    fwd, bwd = cute
    bwd.result = (DQ, DK, DV)  # older builds return three gradients
    be = FA4Backend()
    be.forward(Q, K, V, None, causal=True, softmax_scale=0.3)
    assert fwd.only[1]["startend_row_indices"] is None and fwd.only[1]["softmax_scale"] == 0.3
    assert be.backward(Q, K, V, OUT, LSE, None, DOUT, causal=True, softmax_scale=None) == (
        DQ,
        DK,
        DV,
    )
    args, kwargs = bwd.only
    assert args[6] is None and kwargs["deterministic"] is False
    be.backward(Q, K, V, OUT, LSE, None, DOUT, causal=True, softmax_scale=None, deterministic=True)
    assert bwd.calls[-1][1]["deterministic"] is True


def test_fa4_unavailable_import_error_propagates(monkeypatch) -> None:
    def missing():
        raise ImportError("No module named 'paddlefleet_ops'")

    monkeypatch.setattr(fa_dispatch, "import_cute_fa4", missing)
    with pytest.raises(ImportError, match="paddlefleet_ops"):
        FA4Backend().forward(Q, K, V, IDX, causal=False, softmax_scale=None)


# ------------------------------------------------------- FLAGS_flash_attn_version in the op

BACKENDS = {2: FA2Backend, 3: FA3Backend, 4: FA4Backend}


def _run_both(be: Any, idx: Any) -> None:
    be.forward(Q, K, V, idx, causal=True, softmax_scale=None)
    be.backward(Q, K, V, OUT, LSE, idx, DOUT, causal=True, softmax_scale=None)


@pytest.mark.parametrize("before", [None, "2", "3", "4"])
@pytest.mark.parametrize("version", [2, 3, 4])
def test_op_sees_the_effective_version_in_the_flag(
    ops, cute, monkeypatch, version: int, before: str | None
) -> None:
    """Paddle's FA2 ops read FLAGS_flash_attn_version themselves: inside every op call of
    every backend the flag says the backend's (effective) version, and it is restored after."""
    monkeypatch.setattr(F, "flashmask_attention", _api_block_mask)
    if before is not None:
        monkeypatch.setenv(fa_dispatch.FLAG_VERSION, before)
    be = BACKENDS[version]()
    for idx in (IDX, None):
        _run_both(be, idx)
    recorders = [*ops.values(), *cute]
    seen = [f for rec in recorders for f in rec.flags]
    assert len(seen) == 4  # forward and backward, with and without a mask
    assert set(seen) == {str(version)}
    assert flag_now() == before


def test_flag_restored_when_the_op_raises(ops, monkeypatch) -> None:
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "3")

    def boom(*args: Any) -> Any:
        assert flag_now() == "2"
        raise RuntimeError("kernel failed")

    from paddle import _C_ops

    monkeypatch.setattr(_C_ops, "flashmask_attention", boom)
    with pytest.raises(RuntimeError, match="kernel failed"):
        FA2Backend().forward(Q, K, V, IDX, causal=True, softmax_scale=None)
    assert flag_now() == "3"


def test_flag_held_through_paddles_registry(ops, monkeypatch) -> None:
    """On a GPU build the flag lives in Paddle's registry (get_flags / set_flags)."""
    import paddle

    registry_flags = {fa_dispatch.FLAG_VERSION: 3}
    sets: list[dict[str, Any]] = []

    def get_flags(names: list[str]) -> dict[str, Any]:
        return {n: registry_flags[n] for n in names}

    def set_flags(values: dict[str, Any]) -> None:
        sets.append(dict(values))
        registry_flags.update(values)

    monkeypatch.setattr(paddle, "get_flags", get_flags)
    monkeypatch.setattr(paddle, "set_flags", set_flags)
    rec = ops["flashmask_attention"]
    rec.result = lambda *a: (registry_flags[fa_dispatch.FLAG_VERSION], None, LSE, SEED)
    out, _ = FA2Backend().forward(Q, K, V, IDX, causal=True, softmax_scale=None)
    assert out == 2  # what the op saw
    assert registry_flags[fa_dispatch.FLAG_VERSION] == 3  # restored
    assert sets == [{fa_dispatch.FLAG_VERSION: 2}, {fa_dispatch.FLAG_VERSION: 3}]
    # already the effective version: left alone
    sets.clear()
    FA3Backend().forward(Q, K, V, IDX, causal=True, softmax_scale=None)
    assert sets == []
    assert ops["flashmask_attention_v2"].calls


# ------------------------------------------------------------------------------ registry


@pytest.mark.parametrize(
    ("version", "device", "cls"),
    [
        (2, "cpu", CpuReferenceBackend),
        (3, "cpu", CpuReferenceBackend),
        (4, "cpu", CpuReferenceBackend),
        (2, "gpu:0", FA2Backend),
        (3, "gpu:1", FA3Backend),
        (4, "gpu", FA4Backend),
        (3, "cuda", FA3Backend),
        (2, "xpu:0", FA2Backend),
    ],
)
def test_registry_table(version: int, device: str, cls: type) -> None:
    assert registry.backend_class(version, device) is cls
    backend = registry.get_backend(version, device)
    assert isinstance(backend, cls) and isinstance(backend, AttentionBackend)
    assert registry.get_backend(version, device) is backend  # shared, stateless


@pytest.mark.parametrize(
    ("version", "device", "match"),
    [
        (1, "cpu", "fa_version=1"),
        (5, "gpu:0", "fa_version=5"),
        (True, "gpu:0", "fa_version=True"),
        (3, "xpu:0", "XPU only runs FA2"),
        (2, "npu:0", "not supported"),
    ],
)
def test_registry_rejects(version: Any, device: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        registry.get_backend(version, device)


class _Place:
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def is_gpu_place(self) -> bool:
        return self.kind == "gpu"

    def is_xpu_place(self) -> bool:
        return self.kind == "xpu"

    def is_cpu_place(self) -> bool:
        return self.kind == "cpu"

    def is_cuda_pinned_place(self) -> bool:
        return False

    def gpu_device_id(self) -> int:
        return 1

    def xpu_device_id(self) -> int:
        return 2


class _Placed:
    def __init__(self, kind: str) -> None:
        self.place = _Place(kind)


def test_device_of() -> None:
    assert registry.device_of(paddle.ones([1])) == "cpu"
    assert registry.device_of(_Placed("gpu")) == "gpu:1"
    assert registry.device_of(_Placed("xpu")) == "xpu:2"
    with pytest.raises(ValueError, match="not supported"):
        registry.device_of(_Placed("ipu"))
    assert default_scale(64) == SCALE


# ------------------------------------------------------------ forward/backward agreement


class SpyBackend:
    """Delegates to the CPU reference and records (version, phase)."""

    name = "spy"

    def __init__(self, version: int, log: list[tuple[int, str]]) -> None:
        self.version, self.log, self.cpu = version, log, CpuReferenceBackend()

    def forward(self, *args: Any, **kwargs: Any):
        self.log.append((self.version, "forward"))
        return self.cpu.forward(*args, **kwargs)

    def backward(self, *args: Any, **kwargs: Any):
        self.log.append((self.version, "backward"))
        return self.cpu.backward(*args, **kwargs)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    log: list[tuple[int, str]] = []
    monkeypatch.setattr(registry, "get_backend", lambda version, device: SpyBackend(version, log))
    return log


def _qkv(hq: int = 4, hkv: int = 2):
    rng = np.random.default_rng(0)
    shapes = [(1, 16, hq, 8), (1, 16, hkv, 8), (1, 16, hkv, 8)]
    return [
        paddle.to_tensor(rng.standard_normal(s).astype("float32"), stop_gradient=False)
        for s in shapes
    ]


@pytest.mark.parametrize(
    ("flag", "policy", "expect", "later_flag"),
    [("3", None, 3, "2"), ("2", None, 2, "3"), ("4", "fallback", 3, "2"), ("3", None, 3, "4")],
)
def test_backward_uses_forward_version(spy, monkeypatch, flag, policy, expect, later_flag) -> None:
    """Flags changed between forward and backward never change the backward's version."""
    q, k, v = _qkv()
    monkeypatch.setattr(fa_dispatch, "probe_fa3", lambda: (True, "test"))  # an FA3 card
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, flag)
    out = flashmask_attention(q, k, v, causal=True, fa4_unavailable=policy)
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, later_flag)  # would resolve differently now
    monkeypatch.setenv(fa_dispatch.FLAG_DETERMINISTIC, "1")
    out.sum().backward()
    assert spy == [(expect, "forward"), (expect, "backward")]
    assert q.grad is not None and k.grad is not None


def test_fa4_unavailable_raises_before_any_kernel(spy, monkeypatch) -> None:
    q, k, v = _qkv()
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "4")
    with pytest.raises(fa_dispatch.FlashAttnUnavailableError):
        flashmask_attention(q, k, v, causal=True)
    assert spy == []


# ------------------------------------------------------ GPU backends end to end, faked


flags_seen: list[str | None] = []
"""FLAGS_flash_attn_version as each faked GPU op saw it (`_fake_gpu_ops`)."""


def _fake_gpu_ops(monkeypatch, cpu: CpuReferenceBackend) -> list[str]:
    """Make the FA ops compute with the CPU reference, so the GPU paths run end to end."""
    flags_seen.clear()
    from paddle import _C_ops

    ran: list[str] = []

    def logged(name, fn):
        def wrapper(*args, **kwargs):
            ran.append(name)
            flags_seen.append(flag_now())
            return fn(*args, **kwargs)

        return wrapper

    def fm2(q, k, v, idx, seed, dropout, causal, ret_sm, is_test, rng):
        assert seed is None and dropout == 0.0 and not ret_sm and not is_test and rng == ""
        out, lse = cpu.forward(q, k, v, idx, causal=causal, softmax_scale=None)
        return out, None, lse, paddle.zeros([2], dtype="int64")

    def fm2_grad(q, k, v, idx, out, lse, seed, dout, dropout, causal):
        return cpu.backward(q, k, v, out, lse, idx, dout, causal=causal, softmax_scale=None)

    def fm3(q, k, v, idx, block_mask, scale, causal):
        return cpu.forward(q, k, v, idx, causal=causal, softmax_scale=scale)

    def fm3_grad(q, k, v, out, lse, idx, block_mask, dout, scale, causal):
        return cpu.backward(q, k, v, out, lse, idx, dout, causal=causal, softmax_scale=scale)

    def c4_fwd(q, k, v, *, causal, return_lse, startend_row_indices, softmax_scale, pack_gqa):
        return cpu.forward(
            q, k, v, startend_row_indices, causal=causal, softmax_scale=softmax_scale
        )

    def c4_bwd(q, k, v, out, dout, lse, info, *, softmax_scale, causal, deterministic):
        idx = None if info is None else info.startend_row_indices
        return (
            *cpu.backward(q, k, v, out, lse, idx, dout, causal=causal, softmax_scale=softmax_scale),
            None,
        )

    monkeypatch.setattr(_C_ops, "flashmask_attention", logged("fa2", fm2))
    monkeypatch.setattr(_C_ops, "flashmask_attention_grad", logged("fa2_grad", fm2_grad))
    monkeypatch.setattr(_C_ops, "flashmask_attention_v2", logged("fa3", fm3))
    monkeypatch.setattr(_C_ops, "flashmask_attention_v2_grad", logged("fa3_grad", fm3_grad))
    monkeypatch.setattr(F, "flashmask_attention", _api_block_mask)
    cute = (logged("fa4", c4_fwd), logged("fa4_grad", c4_bwd), FakeInfo)
    monkeypatch.setattr(fa_dispatch, "import_cute_fa4", lambda: cute)
    return ran


@pytest.mark.parametrize("version", [2, 3, 4])
def test_gpu_backends_through_pylayer(monkeypatch, version: int) -> None:
    """The PyLayer on a (faked) GPU device: same numbers as the CPU reference path."""
    cpu = CpuReferenceBackend(block_q=8, block_k=8)
    monkeypatch.setitem(registry._instances, registry.CPU_BACKEND, cpu)
    ran = _fake_gpu_ops(monkeypatch, cpu)
    idx = paddle.to_tensor(np.array([10] * 10 + [16] * 6, dtype=np.int32).reshape(1, 1, 16, 1))
    q, k, v = _qkv()
    ref = flashmask_attention_with_version(q, k, v, idx, causal=True, fa_version=version)
    ref.sum().backward()
    ref_grads = [t.grad.numpy().copy() for t in (q, k, v)]
    for t in (q, k, v):
        t.clear_gradient()

    monkeypatch.setattr(registry, "device_of", lambda t: "gpu:0")
    out = flashmask_attention_with_version(
        q, k, v, idx, causal=True, fa_version=version, validate=False
    )
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "2" if version != 2 else "3")
    out.sum().backward()
    assert ran == [f"fa{version}", f"fa{version}_grad"]
    assert flags_seen == [str(version)] * 2  # the ops saw the version they belong to
    np.testing.assert_array_equal(out.numpy(), ref.numpy())
    for t, want in zip((q, k, v), ref_grads, strict=True):
        np.testing.assert_array_equal(t.grad.numpy(), want)


@pytest.mark.parametrize(
    ("flag", "fa3_card", "det", "head_dim", "policy"),
    [
        ("3", True, "1", 192, None),  # deterministic FA3 with head_dim > 128 -> 2
        ("3", False, "0", 64, "fallback"),  # no FA3 on this card -> 2
        ("4", False, "0", 64, "fallback"),  # no FA4, no FA3 -> 2
    ],
)
def test_fa2_op_sees_2_when_the_flag_says_otherwise(
    monkeypatch, flag, fa3_card, det, head_dim, policy
) -> None:
    """Issue 13 point 4: effective version 2 while the user's flag says 3 (or 4): the FA2 ops,
    which read the flag themselves, must see 2; the user's flag is back afterwards."""
    cpu = CpuReferenceBackend(block_q=8, block_k=8)
    ran = _fake_gpu_ops(monkeypatch, cpu)
    monkeypatch.setattr(fa_dispatch, "probe_fa3", lambda: (fa3_card, "test"))
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, flag)
    monkeypatch.setenv(fa_dispatch.FLAG_DETERMINISTIC, det)
    rng = np.random.default_rng(3)
    q, k, v = (
        paddle.to_tensor(rng.standard_normal((1, 16, 2, head_dim)).astype("float32"),
                         stop_gradient=False)
        for _ in range(3)
    )  # fmt: skip
    version = fa_dispatch.resolve_current(head_dim, policy=policy).version
    assert version == 2
    monkeypatch.setattr(registry, "device_of", lambda t: "gpu:0")
    idx = paddle.to_tensor(np.full((1, 1, 16, 1), 16, dtype=np.int32))
    out = flashmask_attention_with_version(
        q, k, v, idx, causal=True, fa_version=version, validate=False
    )
    out.sum().backward()
    assert ran == ["fa2", "fa2_grad"] and flags_seen == ["2", "2"]
    assert flag_now() == flag


# ------------------------------------------------------ FA4 kernel limits, per call


@pytest.fixture
def sm100(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Pretend an SM100 card with the CuTe kernels importable, FLAGS_flash_attn_version=4."""
    monkeypatch.setattr(fa_dispatch, "probe_capability", lambda: (10, 0))
    monkeypatch.setattr(fa_dispatch, "_probe_cute", lambda: (True, "test"))
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "4")
    return monkeypatch


def test_cp_rebasing_makes_fa4_unavailable_for_causal_two_column_masks(sm100) -> None:
    """Under CP a causal 2-column mask becomes a 4-column one, which the SM100 CuTe kernel
    refuses (upstream sends such masks to FA2/FA3): the plan must not pick FA4 for it."""
    from flashcp.attention.allgather_kv import plan_cp_attention
    from flashcp.cp.layout import Assignment

    class Rank0Of2:
        nranks, rank = 2, 0

    rng = np.random.default_rng(0)
    q = paddle.to_tensor(rng.standard_normal((1, 16, 2, 8)).astype("float32"))
    k = paddle.to_tensor(rng.standard_normal((1, 16, 2, 8)).astype("float32"))
    asg = Assignment.dualchunk(2)
    one_col = mask_families.FAMILIES["causal_document"](1, 32, 1, 0)
    plan = plan_cp_attention(q, k, one_col.indices, group=Rank0Of2(), causal=True, assignment=asg)
    assert plan.version == 4 and plan.mask.shape[-1] == 2
    two_col = mask_families.FAMILIES["causal_blockwise"](1, 32, 1, 0)
    assert two_col.causal and two_col.indices.shape[-1] == 2
    with pytest.raises(fa_dispatch.FlashAttnUnavailableError, match="4-column"):
        plan_cp_attention(q, k, two_col.indices, group=Rank0Of2(), causal=True, assignment=asg)
    plan = plan_cp_attention(
        q, k, two_col.indices, group=Rank0Of2(), causal=True, assignment=asg,
        fa4_unavailable="fallback",
    )  # fmt: skip
    assert plan.mask.shape[-1] == 4 and plan.version == 2  # SM100 has no FA3 either


def test_front_door_checks_mask_heads_against_fa4(sm100) -> None:
    """Mask heads = query heads != KV heads: beyond the CuTe kernel, refused before compute."""
    q, k, v = _qkv(hq=4, hkv=2)
    per_q_head = paddle.to_tensor(np.full((1, 4, 16, 1), 16, dtype=np.int32))
    with pytest.raises(fa_dispatch.FlashAttnUnavailableError, match="4 mask heads"):
        flashmask_attention(q, k, v, per_q_head, causal=True)
    per_kv_head = paddle.to_tensor(np.full((1, 2, 16, 1), 16, dtype=np.int32))
    out = flashmask_attention(q, k, v, per_kv_head, causal=True)  # FA4 -> CPU reference here
    assert list(out.shape) == [1, 16, 4, 8]
