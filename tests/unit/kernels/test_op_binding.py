"""The real `paddle._C_ops` FlashAttention ops bind to the backends' exact argument lists (issue
13 point 7), checked on CPU.

Every op an FA2/FA3 backend calls is run for real, through the backend's own forward and
backward (with and without a mask), on tiny CPU float16 tensors. The CPU build has no kernel for
these ops, so a call whose argument count and types bind gets as far as Paddle's "(NotFound) The
kernel `op` is not registered" - anything else (TypeError / ValueError from the binding) means
the arguments drifted from this Paddle's op. The pybind layer ignores surplus trailing
arguments and reads past the end of a short argument tuple (a segfault), so each call is also
replayed with its last argument replaced by a wrong-typed object: the binding must reject
exactly that position, which pins the op's arity to the backend's argument count. The probe runs
in a subprocess so that a crash fails the test instead of the test session.

The FA4 backend calls the CuTe kernels of `paddlefleet_ops` (not on PyPI, not on CPU); its call
layout is checked against upstream's signature in `test_backends.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import json, sys
    import paddle
    from paddle import _C_ops
    from flashcp.kernels import FA2Backend, FA3Backend

    OPS = ["flash_attn", "flash_attn_grad", "flashmask_attention", "flashmask_attention_grad",
           "flash_attn_v3", "flash_attn_v3_grad", "flashmask_attention_v2",
           "flashmask_attention_v2_grad"]
    real = {name: getattr(_C_ops, name) for name in OPS}
    calls = []

    def recording(name):
        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            return real[name](*args, **kwargs)
        return call

    for name in OPS:
        setattr(_C_ops, name, recording(name))

    def emit(**row):
        print(json.dumps(row), flush=True)

    q = paddle.ones([1, 8, 2, 16], dtype="float16")
    kv = paddle.ones([1, 8, 1, 16], dtype="float16")
    idx = paddle.full([1, 1, 8, 1], 8, dtype="int32")
    lse = paddle.zeros([1, 2, 8], dtype="float32")
    for backend in (FA2Backend(), FA3Backend()):
        for mask in (idx, None):
            for phase in ("forward", "backward"):
                where = f"{backend.name}.{phase}, mask={'yes' if mask is not None else 'no'}"
                emit(kind="start", where=where)
                before = len(calls)
                try:
                    if phase == "forward":
                        backend.forward(q, kv, kv, mask, causal=True, softmax_scale=None)
                    else:
                        backend.backward(q, kv, kv, q, lse, mask, q, causal=True,
                                         softmax_scale=None)
                    error, message = None, ""
                except Exception as exc:
                    error, message = type(exc).__name__, str(exc)
                new = calls[before:]
                name, args, kwargs = new[-1] if new else (None, (), {})
                emit(kind="call", where=where, op=name, ops_called=len(new), nargs=len(args),
                     kwargs=sorted(kwargs), error=error, message=message[:300])
                if name is None:
                    continue
                bad = list(args)
                bad[-1] = object()
                emit(kind="start", where=where + " (last argument mistyped)")
                try:
                    real[name](*bad, **kwargs)
                    error, message = None, ""
                except Exception as exc:
                    error, message = type(exc).__name__, str(exc)
                emit(kind="arity", where=where, op=name, nargs=len(args), error=error,
                     message=message[:300])
    emit(kind="done")
    """
)


@pytest.fixture(scope="module")
def probe() -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=240, check=False
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    last = rows[-1] if rows else {}
    assert proc.returncode == 0 and last.get("kind") == "done", (
        f"the op probe died (exit {proc.returncode}) during {last.get('where')!r}: a call with "
        f"too few arguments makes Paddle's binding read past the argument tuple.\\n"
        f"{proc.stderr[-2000:]}"
    )
    return rows


# (backend.phase, mask) -> the op it must call, by the layouts the backends document.
EXPECTED_OPS = {
    "fa2.forward, mask=yes": "flashmask_attention",
    "fa2.backward, mask=yes": "flashmask_attention_grad",
    "fa2.forward, mask=no": "flash_attn",
    "fa2.backward, mask=no": "flash_attn_grad",
    "fa3.forward, mask=yes": "flashmask_attention_v2",
    "fa3.backward, mask=yes": "flashmask_attention_v2_grad",
    "fa3.forward, mask=no": "flash_attn_v3",
    "fa3.backward, mask=no": "flash_attn_v3_grad",
}


def _rows(probe: list[dict], kind: str) -> dict[str, dict]:
    return {r["where"]: r for r in probe if r["kind"] == kind}


@pytest.mark.parametrize("where", sorted(EXPECTED_OPS))
def test_backend_call_binds_to_the_real_op(probe, where: str) -> None:
    row = _rows(probe, "call")[where]
    op = EXPECTED_OPS[where]
    assert row["op"] == op and row["ops_called"] == 1, row
    assert row["kwargs"] == [], "the ops take positional arguments only"
    assert row["error"] == "RuntimeError", (
        f"{where}: {op} raised {row['error']} instead of 'kernel not registered' - the "
        f"backend's argument list no longer binds: {row['message']}"
    )
    assert f"The kernel `{op}` is not registered" in row["message"], row["message"]


@pytest.mark.parametrize("where", sorted(EXPECTED_OPS))
def test_backend_passes_exactly_the_ops_arity(probe, where: str) -> None:
    row = _rows(probe, "arity")[where]
    assert row["error"] in ("TypeError", "ValueError"), (
        f"{where}: {row['op']} ignored a mistyped last argument: the backend passes more "
        f"arguments ({row['nargs']}) than the op takes"
    )
    assert f"{row['op']}(): argument" in row["message"]
    assert f"(position {row['nargs']})" in row["message"], row["message"]
