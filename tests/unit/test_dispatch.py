"""The fa_version rule: all 48 rows of the decision table, both FA4 policies, XPU, bad input.

Expected values are written out (reference: paddlefleet-cp-and-dispatch.md §1.4, column D),
not recomputed, so a broken rule fails here.
"""

from __future__ import annotations

import logging

import pytest

from flashcp import dispatch
from flashcp.dispatch import (
    FlashAttnUnavailableError,
    explain_fa_version,
    resolve_fa_version,
)
from flashcp.log import reset_once

R = "RAISE"
# row, requested, FA4 available, block_mask API, deterministic, head_dim,
# expected with fa4_unavailable="fallback", expected with fa4_unavailable="error"
TABLE = [
    (1, 2, "Y", "Y", "N", 128, 2, 2),
    (2, 2, "Y", "Y", "N", 192, 2, 2),
    (3, 2, "Y", "Y", "Y", 128, 2, 2),
    (4, 2, "Y", "Y", "Y", 192, 2, 2),
    (5, 2, "Y", "N", "N", 128, 2, 2),
    (6, 2, "Y", "N", "N", 192, 2, 2),
    (7, 2, "Y", "N", "Y", 128, 2, 2),
    (8, 2, "Y", "N", "Y", 192, 2, 2),
    (9, 2, "N", "Y", "N", 128, 2, 2),
    (10, 2, "N", "Y", "N", 192, 2, 2),
    (11, 2, "N", "Y", "Y", 128, 2, 2),
    (12, 2, "N", "Y", "Y", 192, 2, 2),
    (13, 2, "N", "N", "N", 128, 2, 2),
    (14, 2, "N", "N", "N", 192, 2, 2),
    (15, 2, "N", "N", "Y", 128, 2, 2),
    (16, 2, "N", "N", "Y", 192, 2, 2),
    (17, 3, "Y", "Y", "N", 128, 3, 3),
    (18, 3, "Y", "Y", "N", 192, 3, 3),
    (19, 3, "Y", "Y", "Y", 128, 3, 3),
    (20, 3, "Y", "Y", "Y", 192, 2, 2),
    (21, 3, "Y", "N", "N", 128, 3, 3),
    (22, 3, "Y", "N", "N", 192, 3, 3),
    (23, 3, "Y", "N", "Y", 128, 2, 2),
    (24, 3, "Y", "N", "Y", 192, 2, 2),
    (25, 3, "N", "Y", "N", 128, 3, 3),
    (26, 3, "N", "Y", "N", 192, 3, 3),
    (27, 3, "N", "Y", "Y", 128, 3, 3),
    (28, 3, "N", "Y", "Y", 192, 2, 2),
    (29, 3, "N", "N", "N", 128, 3, 3),
    (30, 3, "N", "N", "N", 192, 3, 3),
    (31, 3, "N", "N", "Y", 128, 2, 2),
    (32, 3, "N", "N", "Y", 192, 2, 2),
    (33, 4, "Y", "Y", "N", 128, 4, 4),
    (34, 4, "Y", "Y", "N", 192, 4, 4),
    (35, 4, "Y", "Y", "Y", 128, 4, 4),
    (36, 4, "Y", "Y", "Y", 192, 4, 4),
    (37, 4, "Y", "N", "N", 128, 4, 4),
    (38, 4, "Y", "N", "N", 192, 4, 4),
    (39, 4, "Y", "N", "Y", 128, 4, 4),
    (40, 4, "Y", "N", "Y", 192, 4, 4),
    (41, 4, "N", "Y", "N", 128, 3, R),
    (42, 4, "N", "Y", "N", 192, 3, R),
    (43, 4, "N", "Y", "Y", 128, 3, R),
    (44, 4, "N", "Y", "Y", 192, 2, R),
    (45, 4, "N", "N", "N", 128, 3, R),
    (46, 4, "N", "N", "N", 192, 3, R),
    (47, 4, "N", "N", "Y", 128, 2, R),
    (48, 4, "N", "N", "Y", 192, 2, R),
]


def test_table_is_complete() -> None:
    keys = {(r[1], r[2], r[3], r[4], r[5]) for r in TABLE}
    assert len(TABLE) == 48 and len(keys) == 48
    assert [r[0] for r in TABLE] == list(range(1, 49))


def _kwargs(fa4: str, bm: str, det: str, hd: int) -> dict:
    return dict(
        fa4_available=fa4 == "Y", block_mask_api=bm == "Y", deterministic=det == "Y", head_dim=hd
    )


@pytest.mark.parametrize("policy", ["fallback", "error"])
@pytest.mark.parametrize(("row", "req", "fa4", "bm", "det", "hd", "fallback", "error"), TABLE)
def test_decision_table(row, req, fa4, bm, det, hd, fallback, error, policy) -> None:
    expected = fallback if policy == "fallback" else error
    kwargs = _kwargs(fa4, bm, det, hd)
    if expected == R:
        with pytest.raises(FlashAttnUnavailableError) as info:
            resolve_fa_version(req, fa4_unavailable=policy, **kwargs)
        msg = str(info.value)
        assert "CuTe" in msg and "SM100" in msg and "FLAGS_flash_attn_version" in msg
        assert "3 or 2" in msg
        assert isinstance(info.value, NotImplementedError)
    else:
        assert resolve_fa_version(req, fa4_unavailable=policy, **kwargs) == expected, f"row {row}"


def test_default_policy_is_error() -> None:
    with pytest.raises(FlashAttnUnavailableError):
        resolve_fa_version(
            4, fa4_available=False, block_mask_api=True, deterministic=False, head_dim=128
        )


@pytest.mark.parametrize("req", [2, 3, 4])
@pytest.mark.parametrize("device", ["xpu", "xpu:0", "XPU:3"])
def test_xpu_is_always_fa2(req: int, device: str) -> None:
    for fa4 in (True, False):
        for det in (True, False):
            got = resolve_fa_version(
                req,
                fa4_available=fa4,
                block_mask_api=False,
                deterministic=det,
                head_dim=256,
                device=device,
            )
            assert got == 2


@pytest.mark.parametrize("bad", [0, 1, 5, -3, True, "3", 3.0, None])
def test_invalid_requested_version(bad) -> None:
    with pytest.raises(ValueError, match="FLAGS_flash_attn_version"):
        resolve_fa_version(
            bad, fa4_available=True, block_mask_api=True, deterministic=False, head_dim=128
        )


@pytest.mark.parametrize("policy", ["Error", "warn", "", "fallback3"])
def test_invalid_policy(policy: str) -> None:
    with pytest.raises(ValueError, match="fa4_unavailable"):
        resolve_fa_version(
            3,
            fa4_available=True,
            block_mask_api=True,
            deterministic=False,
            head_dim=128,
            fa4_unavailable=policy,
        )


@pytest.mark.parametrize("hd", [0, -1, True, 64.0])
def test_invalid_head_dim(hd) -> None:
    with pytest.raises(ValueError, match="head_dim"):
        resolve_fa_version(
            3, fa4_available=True, block_mask_api=True, deterministic=False, head_dim=hd
        )


def test_fallback_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    reset_once("dispatch:")
    kwargs = _kwargs("N", "Y", "N", 128)
    with caplog.at_level(logging.WARNING, logger="flashcp"):
        for _ in range(3):
            resolve_fa_version(4, fa4_unavailable="fallback", **kwargs)
    warnings = [r for r in caplog.records if "falling back to FA3" in r.getMessage()]
    assert len(warnings) == 1


def test_explain_names_the_rule() -> None:
    res = explain_fa_version(3, **_kwargs("Y", "Y", "Y", 192))
    assert res.version == 2 and "head_dim <= 128" in res.reason and "192" in res.reason
    res = explain_fa_version(3, **_kwargs("Y", "N", "Y", 64))
    assert res.version == 2 and "block_mask" in res.reason
    res = explain_fa_version(4, fa4_unavailable="fallback", **_kwargs("N", "Y", "Y", 192))
    assert res.version == 2
    assert res.reason.startswith("FA4 requested but unavailable")
    assert "downgraded to 2" in res.reason
    res = explain_fa_version(4, **_kwargs("Y", "N", "Y", 192))
    assert (res.version, res.reason) == (4, "requested 4")
    res = explain_fa_version(2, device="xpu", **_kwargs("Y", "Y", "N", 64))
    assert "XPU" in res.reason


# ----------------------------------------------------------------------- probe


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch):
    for key in (dispatch.FLAG_VERSION, dispatch.FLAG_DETERMINISTIC, dispatch.ENV_FA4_POLICY):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_probe_defaults_on_cpu(clean_env) -> None:
    inputs = dispatch.probe_inputs()
    assert inputs.requested == 2
    assert inputs.deterministic is False
    assert inputs.fa4_available is False
    assert inputs.fa4_unavailable == "error"
    assert inputs.device.startswith("cpu")
    assert inputs.block_mask_api is True  # paddle 3.3.1's flashmask_attention takes block_mask
    assert inputs.sources[dispatch.FLAG_VERSION] == "default"


def test_probe_reads_environment(clean_env) -> None:
    clean_env.setenv(dispatch.FLAG_VERSION, "3")
    clean_env.setenv(dispatch.FLAG_DETERMINISTIC, "true")
    clean_env.setenv(dispatch.ENV_FA4_POLICY, "fallback")
    inputs = dispatch.probe_inputs()
    assert (inputs.requested, inputs.deterministic, inputs.fa4_unavailable) == (3, True, "fallback")
    assert inputs.sources[dispatch.FLAG_VERSION] == "environment"
    assert inputs.sources["fa4_unavailable"] == "environment"
    # An explicit config policy wins over the environment.
    assert dispatch.probe_inputs(policy="error").fa4_unavailable == "error"
    assert dispatch.probe_inputs(deterministic=False).deterministic is False


def test_probe_rejects_garbage(clean_env) -> None:
    clean_env.setenv(dispatch.FLAG_VERSION, "three")
    with pytest.raises(ValueError, match="FLAGS_flash_attn_version='three'"):
        dispatch.probe_inputs()
    clean_env.setenv(dispatch.FLAG_VERSION, "3")
    clean_env.setenv(dispatch.FLAG_DETERMINISTIC, "maybe")
    with pytest.raises(ValueError, match="FLAGS_cudnn_deterministic"):
        dispatch.probe_inputs()
    clean_env.setenv(dispatch.FLAG_DETERMINISTIC, "0")
    clean_env.setenv(dispatch.ENV_FA4_POLICY, "sometimes")
    with pytest.raises(ValueError, match="FLASHCP_FA4_UNAVAILABLE"):
        dispatch.probe_inputs()


def test_read_flag_prefers_paddle_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    import paddle

    monkeypatch.setattr(paddle, "get_flags", lambda names: {names[0]: 3})
    monkeypatch.setenv(dispatch.FLAG_VERSION, "2")
    assert dispatch.probe_requested_version() == (3, "paddle.get_flags")


def test_resolve_current_on_cpu(clean_env, caplog: pytest.LogCaptureFixture) -> None:
    reset_once("dispatch:")
    with caplog.at_level(logging.INFO, logger="flashcp"):
        assert dispatch.resolve_current(64).version == 2
        assert dispatch.resolve_current(64).version == 2
    assert sum("fa_version=2" in r.getMessage() for r in caplog.records) == 1
    clean_env.setenv(dispatch.FLAG_VERSION, "4")
    with pytest.raises(FlashAttnUnavailableError):
        dispatch.resolve_current(64)
    res = dispatch.resolve_current(64, policy="fallback")
    assert res.version == 3


def test_block_mask_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    import paddle.nn.functional as F

    dispatch.probe_block_mask_api.cache_clear()
    monkeypatch.setattr(F, "flashmask_attention", lambda q, k, v, startend_row_indices=None: q)
    assert dispatch.probe_block_mask_api() is False
    dispatch.probe_block_mask_api.cache_clear()
    monkeypatch.delattr(F, "flashmask_attention")
    assert dispatch.probe_block_mask_api() is False
    dispatch.probe_block_mask_api.cache_clear()


class _FakeCuda:
    def __init__(self, count: int, major: int) -> None:
        self.count, self.major = count, major

    def device_count(self) -> int:
        return self.count

    def get_device_capability(self) -> tuple[int, int]:
        return (self.major, 0)


@pytest.mark.parametrize(
    ("compiled", "count", "major", "importable", "available", "detail"),
    [
        (False, 0, 0, True, False, "no CUDA device"),
        (True, 0, 9, True, False, "no CUDA device"),
        (True, 1, 9, True, False, "major 9"),
        (True, 1, 10, False, False, "import failed"),
        (True, 1, 10, True, True, "SM100"),
    ],
)
def test_fa4_probe(monkeypatch, compiled, count, major, importable, available, detail) -> None:
    import sys
    import types

    import paddle

    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: compiled)
    monkeypatch.setattr(paddle.device, "cuda", _FakeCuda(count, major))
    if importable:
        iface = types.ModuleType(dispatch.CUTE_INTERFACE_MODULE)
        iface._flash_attn_fwd = lambda *a, **k: None
        iface._flash_attn_bwd = lambda *a, **k: None
        utils = types.ModuleType(dispatch.CUTE_UTILS_MODULE)
        utils.FlashMaskInfoPaddle = object
        monkeypatch.setitem(sys.modules, dispatch.CUTE_INTERFACE_MODULE, iface)
        monkeypatch.setitem(sys.modules, dispatch.CUTE_UTILS_MODULE, utils)
    else:
        monkeypatch.setitem(sys.modules, dispatch.CUTE_INTERFACE_MODULE, None)
    dispatch.probe_fa4.cache_clear()
    try:
        ok, why = dispatch.probe_fa4()
    finally:
        dispatch.probe_fa4.cache_clear()
    assert ok is available and detail in why


# ------------------------------------------------------------------ mutants

MUTANTS = {
    # PR #1396 head: the downgrade keyed on the raw flag, skipping the normalised-to-3 case.
    "downgrade keyed on raw flag": (
        "if version == 3 and deterministic:",
        "if requested == 3 and deterministic:",
    ),
    # Pre-#1396: forward falls back but backward is told 4.
    "fallback keeps 4": ("        version = 3\n", "        version = 4\n"),
    "off-by-one head_dim": (
        "head_dim > DETERMINISTIC_MAX_HEAD_DIM",
        "head_dim >= DETERMINISTIC_MAX_HEAD_DIM",
    ),
    "block_mask inverted": ("if not block_mask_api:", "if block_mask_api:"),
    "deterministic FA4 downgraded": (
        "if version == 3 and deterministic:",
        "if version in (3, 4) and deterministic:",
    ),
    "no xpu rule": ('if "xpu" in device.lower():', 'if "xpu" == device:'),
}


def _table_failures(resolve) -> int:
    """Rows (both policies, plus XPU) where `resolve` disagrees with the written-out table."""
    bad = 0
    for _, req, fa4, bm, det, hd, fallback, error in TABLE:
        for policy, expected in (("fallback", fallback), ("error", error)):
            try:
                got = resolve(req, fa4_unavailable=policy, **_kwargs(fa4, bm, det, hd))
            except NotImplementedError:
                got = R
            bad += got != expected
    for req in (2, 3, 4):
        got = resolve(
            req,
            fa4_available=True,
            block_mask_api=True,
            deterministic=False,
            head_dim=64,
            device="xpu:0",
        )
        bad += got != 2
    return bad


def test_real_rule_passes_the_table() -> None:
    assert _table_failures(resolve_fa_version) == 0


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_broken_rule_fails_the_table(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deliberately broken dispatch rule is caught by the table (the suite would go red)."""
    import inspect
    import sys
    import types

    old, new = MUTANTS[name]
    source = inspect.getsource(dispatch)
    assert source.count(old) >= 1, f"mutation site for {name!r} no longer exists"
    mutant = types.ModuleType("flashcp_dispatch_mutant")
    monkeypatch.setitem(sys.modules, mutant.__name__, mutant)  # dataclasses look it up
    exec(compile(source.replace(old, new, 1), "<mutant>", "exec"), mutant.__dict__)
    assert _table_failures(mutant.resolve_fa_version) > 0, f"mutant {name!r} survived"
