"""The fa_version rule: all 144 rows of the decision table, both policies, XPU, bad input.

Expected values are written out, not recomputed, so a broken rule fails here. Rows 1-48 are
the reference table (paddlefleet-cp-and-fa_dispatch.md §1.4, column D) on a card with FA3
(SM90); rows 49-96 repeat them without FA3 (SM80/SM100: "FA3 only supports Hopper GPUs");
rows 97-144 have the FA4 backend but a call beyond its kernel's limits ("M", issue 13 point 3),
which must behave exactly like an unavailable FA4.
"""

from __future__ import annotations

import logging

import pytest

from flashcp import fa_dispatch
from flashcp.fa_dispatch import (
    FlashAttnUnavailableError,
    explain_fa_version,
    resolve_fa_version,
)
from flashcp.log import reset_once

R4 = "RAISE4"  # FlashAttnUnavailableError about FA4
R3 = "RAISE3"  # FlashAttnUnavailableError about FA3
LIMIT = "a 4-column startend_row_indices (test)"
# row, requested, FA3 available, FA4 available (Y / N / M = backend present, call beyond its
# limits), block_mask API, deterministic, head_dim,
# expected with fa4_unavailable="fallback", expected with fa4_unavailable="error"
TABLE = [
    (1, 2, "Y", "Y", "Y", "N", 128, 2, 2),
    (2, 2, "Y", "Y", "Y", "N", 192, 2, 2),
    (3, 2, "Y", "Y", "Y", "Y", 128, 2, 2),
    (4, 2, "Y", "Y", "Y", "Y", 192, 2, 2),
    (5, 2, "Y", "Y", "N", "N", 128, 2, 2),
    (6, 2, "Y", "Y", "N", "N", 192, 2, 2),
    (7, 2, "Y", "Y", "N", "Y", 128, 2, 2),
    (8, 2, "Y", "Y", "N", "Y", 192, 2, 2),
    (9, 2, "Y", "N", "Y", "N", 128, 2, 2),
    (10, 2, "Y", "N", "Y", "N", 192, 2, 2),
    (11, 2, "Y", "N", "Y", "Y", 128, 2, 2),
    (12, 2, "Y", "N", "Y", "Y", 192, 2, 2),
    (13, 2, "Y", "N", "N", "N", 128, 2, 2),
    (14, 2, "Y", "N", "N", "N", 192, 2, 2),
    (15, 2, "Y", "N", "N", "Y", 128, 2, 2),
    (16, 2, "Y", "N", "N", "Y", 192, 2, 2),
    (17, 3, "Y", "Y", "Y", "N", 128, 3, 3),
    (18, 3, "Y", "Y", "Y", "N", 192, 3, 3),
    (19, 3, "Y", "Y", "Y", "Y", 128, 3, 3),
    (20, 3, "Y", "Y", "Y", "Y", 192, 2, 2),
    (21, 3, "Y", "Y", "N", "N", 128, 3, 3),
    (22, 3, "Y", "Y", "N", "N", 192, 3, 3),
    (23, 3, "Y", "Y", "N", "Y", 128, 2, 2),
    (24, 3, "Y", "Y", "N", "Y", 192, 2, 2),
    (25, 3, "Y", "N", "Y", "N", 128, 3, 3),
    (26, 3, "Y", "N", "Y", "N", 192, 3, 3),
    (27, 3, "Y", "N", "Y", "Y", 128, 3, 3),
    (28, 3, "Y", "N", "Y", "Y", 192, 2, 2),
    (29, 3, "Y", "N", "N", "N", 128, 3, 3),
    (30, 3, "Y", "N", "N", "N", 192, 3, 3),
    (31, 3, "Y", "N", "N", "Y", 128, 2, 2),
    (32, 3, "Y", "N", "N", "Y", 192, 2, 2),
    (33, 4, "Y", "Y", "Y", "N", 128, 4, 4),
    (34, 4, "Y", "Y", "Y", "N", 192, 4, 4),
    (35, 4, "Y", "Y", "Y", "Y", 128, 4, 4),
    (36, 4, "Y", "Y", "Y", "Y", 192, 4, 4),
    (37, 4, "Y", "Y", "N", "N", 128, 4, 4),
    (38, 4, "Y", "Y", "N", "N", 192, 4, 4),
    (39, 4, "Y", "Y", "N", "Y", 128, 4, 4),
    (40, 4, "Y", "Y", "N", "Y", 192, 4, 4),
    (41, 4, "Y", "N", "Y", "N", 128, 3, R4),
    (42, 4, "Y", "N", "Y", "N", 192, 3, R4),
    (43, 4, "Y", "N", "Y", "Y", 128, 3, R4),
    (44, 4, "Y", "N", "Y", "Y", 192, 2, R4),
    (45, 4, "Y", "N", "N", "N", 128, 3, R4),
    (46, 4, "Y", "N", "N", "N", 192, 3, R4),
    (47, 4, "Y", "N", "N", "Y", 128, 2, R4),
    (48, 4, "Y", "N", "N", "Y", 192, 2, R4),
    (49, 2, "N", "Y", "Y", "N", 128, 2, 2),
    (50, 2, "N", "Y", "Y", "N", 192, 2, 2),
    (51, 2, "N", "Y", "Y", "Y", 128, 2, 2),
    (52, 2, "N", "Y", "Y", "Y", 192, 2, 2),
    (53, 2, "N", "Y", "N", "N", 128, 2, 2),
    (54, 2, "N", "Y", "N", "N", 192, 2, 2),
    (55, 2, "N", "Y", "N", "Y", 128, 2, 2),
    (56, 2, "N", "Y", "N", "Y", 192, 2, 2),
    (57, 2, "N", "N", "Y", "N", 128, 2, 2),
    (58, 2, "N", "N", "Y", "N", 192, 2, 2),
    (59, 2, "N", "N", "Y", "Y", 128, 2, 2),
    (60, 2, "N", "N", "Y", "Y", 192, 2, 2),
    (61, 2, "N", "N", "N", "N", 128, 2, 2),
    (62, 2, "N", "N", "N", "N", 192, 2, 2),
    (63, 2, "N", "N", "N", "Y", 128, 2, 2),
    (64, 2, "N", "N", "N", "Y", 192, 2, 2),
    (65, 3, "N", "Y", "Y", "N", 128, 2, R3),
    (66, 3, "N", "Y", "Y", "N", 192, 2, R3),
    (67, 3, "N", "Y", "Y", "Y", 128, 2, R3),
    (68, 3, "N", "Y", "Y", "Y", 192, 2, R3),
    (69, 3, "N", "Y", "N", "N", 128, 2, R3),
    (70, 3, "N", "Y", "N", "N", 192, 2, R3),
    (71, 3, "N", "Y", "N", "Y", 128, 2, R3),
    (72, 3, "N", "Y", "N", "Y", 192, 2, R3),
    (73, 3, "N", "N", "Y", "N", 128, 2, R3),
    (74, 3, "N", "N", "Y", "N", 192, 2, R3),
    (75, 3, "N", "N", "Y", "Y", 128, 2, R3),
    (76, 3, "N", "N", "Y", "Y", 192, 2, R3),
    (77, 3, "N", "N", "N", "N", 128, 2, R3),
    (78, 3, "N", "N", "N", "N", 192, 2, R3),
    (79, 3, "N", "N", "N", "Y", 128, 2, R3),
    (80, 3, "N", "N", "N", "Y", 192, 2, R3),
    (81, 4, "N", "Y", "Y", "N", 128, 4, 4),
    (82, 4, "N", "Y", "Y", "N", 192, 4, 4),
    (83, 4, "N", "Y", "Y", "Y", 128, 4, 4),
    (84, 4, "N", "Y", "Y", "Y", 192, 4, 4),
    (85, 4, "N", "Y", "N", "N", 128, 4, 4),
    (86, 4, "N", "Y", "N", "N", 192, 4, 4),
    (87, 4, "N", "Y", "N", "Y", 128, 4, 4),
    (88, 4, "N", "Y", "N", "Y", 192, 4, 4),
    (89, 4, "N", "N", "Y", "N", 128, 2, R4),
    (90, 4, "N", "N", "Y", "N", 192, 2, R4),
    (91, 4, "N", "N", "Y", "Y", 128, 2, R4),
    (92, 4, "N", "N", "Y", "Y", 192, 2, R4),
    (93, 4, "N", "N", "N", "N", 128, 2, R4),
    (94, 4, "N", "N", "N", "N", 192, 2, R4),
    (95, 4, "N", "N", "N", "Y", 128, 2, R4),
    (96, 4, "N", "N", "N", "Y", 192, 2, R4),
    (97, 2, "Y", "M", "Y", "N", 128, 2, 2),
    (98, 2, "Y", "M", "Y", "N", 192, 2, 2),
    (99, 2, "Y", "M", "Y", "Y", 128, 2, 2),
    (100, 2, "Y", "M", "Y", "Y", 192, 2, 2),
    (101, 2, "Y", "M", "N", "N", 128, 2, 2),
    (102, 2, "Y", "M", "N", "N", 192, 2, 2),
    (103, 2, "Y", "M", "N", "Y", 128, 2, 2),
    (104, 2, "Y", "M", "N", "Y", 192, 2, 2),
    (105, 3, "Y", "M", "Y", "N", 128, 3, 3),
    (106, 3, "Y", "M", "Y", "N", 192, 3, 3),
    (107, 3, "Y", "M", "Y", "Y", 128, 3, 3),
    (108, 3, "Y", "M", "Y", "Y", 192, 2, 2),
    (109, 3, "Y", "M", "N", "N", 128, 3, 3),
    (110, 3, "Y", "M", "N", "N", 192, 3, 3),
    (111, 3, "Y", "M", "N", "Y", 128, 2, 2),
    (112, 3, "Y", "M", "N", "Y", 192, 2, 2),
    (113, 4, "Y", "M", "Y", "N", 128, 3, R4),
    (114, 4, "Y", "M", "Y", "N", 192, 3, R4),
    (115, 4, "Y", "M", "Y", "Y", 128, 3, R4),
    (116, 4, "Y", "M", "Y", "Y", 192, 2, R4),
    (117, 4, "Y", "M", "N", "N", 128, 3, R4),
    (118, 4, "Y", "M", "N", "N", 192, 3, R4),
    (119, 4, "Y", "M", "N", "Y", 128, 2, R4),
    (120, 4, "Y", "M", "N", "Y", 192, 2, R4),
    (121, 2, "N", "M", "Y", "N", 128, 2, 2),
    (122, 2, "N", "M", "Y", "N", 192, 2, 2),
    (123, 2, "N", "M", "Y", "Y", 128, 2, 2),
    (124, 2, "N", "M", "Y", "Y", 192, 2, 2),
    (125, 2, "N", "M", "N", "N", 128, 2, 2),
    (126, 2, "N", "M", "N", "N", 192, 2, 2),
    (127, 2, "N", "M", "N", "Y", 128, 2, 2),
    (128, 2, "N", "M", "N", "Y", 192, 2, 2),
    (129, 3, "N", "M", "Y", "N", 128, 2, R3),
    (130, 3, "N", "M", "Y", "N", 192, 2, R3),
    (131, 3, "N", "M", "Y", "Y", 128, 2, R3),
    (132, 3, "N", "M", "Y", "Y", 192, 2, R3),
    (133, 3, "N", "M", "N", "N", 128, 2, R3),
    (134, 3, "N", "M", "N", "N", 192, 2, R3),
    (135, 3, "N", "M", "N", "Y", 128, 2, R3),
    (136, 3, "N", "M", "N", "Y", 192, 2, R3),
    (137, 4, "N", "M", "Y", "N", 128, 2, R4),
    (138, 4, "N", "M", "Y", "N", 192, 2, R4),
    (139, 4, "N", "M", "Y", "Y", 128, 2, R4),
    (140, 4, "N", "M", "Y", "Y", 192, 2, R4),
    (141, 4, "N", "M", "N", "N", 128, 2, R4),
    (142, 4, "N", "M", "N", "N", 192, 2, R4),
    (143, 4, "N", "M", "N", "Y", 128, 2, R4),
    (144, 4, "N", "M", "N", "Y", 192, 2, R4),
]


def test_table_is_complete() -> None:
    keys = {r[1:7] for r in TABLE}
    assert len(TABLE) == 144 and len(keys) == 144
    assert [r[0] for r in TABLE] == list(range(1, 145))


def _capability(fa3: str, fa4: str) -> tuple[int, int]:
    return (9, 0) if fa3 == "Y" else (10, 0) if fa4 != "N" else (8, 0)


def _kwargs(fa3: str, fa4: str, bm: str, det: str, hd: int) -> dict:
    return dict(
        fa3_available=fa3 == "Y",
        fa4_available=fa4 != "N",
        fa4_limit=LIMIT if fa4 == "M" else None,
        capability=_capability(fa3, fa4),
        block_mask_api=bm == "Y",
        deterministic=det == "Y",
        head_dim=hd,
    )


@pytest.mark.parametrize("policy", ["fallback", "error"])
@pytest.mark.parametrize(
    ("row", "req", "fa3", "fa4", "bm", "det", "hd", "fallback", "error"), TABLE
)
def test_decision_table(row, req, fa3, fa4, bm, det, hd, fallback, error, policy) -> None:
    expected = fallback if policy == "fallback" else error
    kwargs = _kwargs(fa3, fa4, bm, det, hd)
    if expected in (R3, R4):
        with pytest.raises(FlashAttnUnavailableError) as info:
            resolve_fa_version(req, fa4_unavailable=policy, **kwargs)
        msg = str(info.value)
        assert "FLAGS_flash_attn_version" in msg and "fallback" in msg
        assert isinstance(info.value, NotImplementedError)
        if expected == R4:
            assert "CuTe" in msg and "SM100" in msg
            assert ("paddlefleet_ops" in msg) == (fa4 == "N")  # what is missing, when it is
            assert (LIMIT in msg) == (fa4 == "M")
            # the advice is what this card runs: FA3 only on SM90 (issue 27, defect 2)
            if fa3 == "Y":
                assert "FLAGS_flash_attn_version=3 (FA3 runs on this SM90" in msg
                assert "fall back to FA3" in msg
            else:
                assert "=3" not in msg and "FLAGS_flash_attn_version=2 (FA2" in msg
                assert "FA3 is unavailable too" in msg and "fall back to FA2" in msg
        else:
            major, minor = _capability(fa3, fa4)
            assert "SM90" in msg and f"compute capability {major}.{minor}" in msg
            assert "FLAGS_flash_attn_version=2" in msg
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
    kwargs = _kwargs("Y", "N", "Y", "N", 128)
    with caplog.at_level(logging.WARNING, logger="flashcp"):
        for _ in range(3):
            resolve_fa_version(4, fa4_unavailable="fallback", **kwargs)
    warnings = [r for r in caplog.records if "falling back to FA3" in r.getMessage()]
    assert len(warnings) == 1


def test_fa3_fallback_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """FA3 on a non-Hopper card under "fallback": 2, with one warning naming the card."""
    reset_once("dispatch:")
    kwargs = _kwargs("N", "N", "Y", "N", 128)
    with caplog.at_level(logging.WARNING, logger="flashcp"):
        for req in (3, 3, 4):  # FA4 -> FA3 -> FA2 warns about each once
            assert resolve_fa_version(req, fa4_unavailable="fallback", **kwargs) == 2
    fa3 = [r.getMessage() for r in caplog.records if "falling back to FA2" in r.getMessage()]
    assert len(fa3) == 1 and "compute capability 8.0" in fa3[0] and "SM90" in fa3[0]
    fa4 = [r for r in caplog.records if "falling back to FA3" in r.getMessage()]
    assert len(fa4) == 1


def test_fa4_limit_warns_once_per_limit(caplog: pytest.LogCaptureFixture) -> None:
    """A call beyond FA4's kernel limits is logged once, naming the limit."""
    reset_once("dispatch:")
    kwargs = _kwargs("N", "M", "Y", "N", 128)
    with caplog.at_level(logging.WARNING, logger="flashcp"):
        for _ in range(3):
            resolve_fa_version(4, fa4_unavailable="fallback", **kwargs)
        kwargs["fa4_limit"] = "another limit"
        resolve_fa_version(4, fa4_unavailable="fallback", **kwargs)
    warnings = [r.getMessage() for r in caplog.records if "falling back to FA3" in r.getMessage()]
    assert len(warnings) == 2 and LIMIT in warnings[0] and "another limit" in warnings[1]


def test_explain_names_the_rule() -> None:
    res = explain_fa_version(3, **_kwargs("Y", "Y", "Y", "Y", 192))
    assert res.version == 2 and "head_dim <= 128" in res.reason and "192" in res.reason
    res = explain_fa_version(3, **_kwargs("Y", "Y", "N", "Y", 64))
    assert res.version == 2 and "block_mask" in res.reason
    res = explain_fa_version(4, fa4_unavailable="fallback", **_kwargs("Y", "N", "Y", "Y", 192))
    assert res.version == 2
    assert res.reason.startswith("FA4 requested but unavailable")
    assert "downgraded to 2" in res.reason
    res = explain_fa_version(4, **_kwargs("Y", "Y", "N", "Y", 192))
    assert (res.version, res.reason) == (4, "requested 4")
    res = explain_fa_version(2, device="xpu", **_kwargs("Y", "Y", "Y", "N", 64))
    assert "XPU" in res.reason
    res = explain_fa_version(4, fa4_unavailable="fallback", **_kwargs("Y", "M", "Y", "N", 64))
    assert res.version == 3 and LIMIT in res.reason and "beyond the SM100 CuTe kernel" in res.reason
    res = explain_fa_version(4, fa4_unavailable="fallback", **_kwargs("N", "N", "Y", "N", 64))
    assert res.version == 2 and "FA3 unavailable" in res.reason and "8.0" in res.reason
    # without a card at all, the messages say so
    kwargs = {**_kwargs("N", "N", "Y", "N", 64), "capability": None}
    with pytest.raises(FlashAttnUnavailableError, match="no CUDA device"):
        explain_fa_version(3, **kwargs)
    # no FA4 backend and a limited call: both reasons are given
    kwargs = {**_kwargs("N", "N", "Y", "N", 64), "fa4_limit": LIMIT}
    with pytest.raises(FlashAttnUnavailableError, match="also a 4-column"):
        explain_fa_version(4, **kwargs)


@pytest.mark.parametrize(
    ("capability", "fa3", "missing", "advice"),
    [
        (None, False, "an SM100 GPU with the paddlefleet_ops CuTe FlashMask kernels "
         "(paddlefleet_ops.flash_mask.cute.interface), and this machine has no CUDA device",
         "FLAGS_flash_attn_version=2 (FA2, Paddle's default): FA3 is unavailable too (FA3 "
         "kernels exist for SM90 (Hopper) only and this machine has no CUDA device"),
        ((8, 0), False, "and this card is SM80 (compute capability 8.0)",
         "FLAGS_flash_attn_version=2 (FA2"),
        ((9, 0), True, "and this card is SM90 (compute capability 9.0)",
         "FLAGS_flash_attn_version=3 (FA3 runs on this SM90 (compute capability 9.0) card) "
         "or 2"),
        ((10, 0), False, "it needs the paddlefleet_ops CuTe FlashMask kernels "
         "(paddlefleet_ops.flash_mask.cute.interface), which this SM100 (compute capability "
         "10.0) card does not have", "FLAGS_flash_attn_version=2 (FA2"),
    ],
    ids=["cpu", "sm80", "sm90", "sm100_without_kernels"],
)  # fmt: skip
def test_fa4_refusal_names_what_is_missing_and_what_this_card_runs(
    capability, fa3, missing, advice
) -> None:
    """Issue 27, defect 2: the advice comes from the availability facts (FA3 only where it
    runs), the reason names what is missing, and an SM100 card is never told it needs SM100."""
    with pytest.raises(FlashAttnUnavailableError) as info:
        explain_fa_version(
            4, fa4_available=False, fa3_available=fa3, capability=capability,
            block_mask_api=True, deterministic=False, head_dim=128,
        )  # fmt: skip
    msg = str(info.value)
    assert missing in msg and advice in msg
    assert ("FLAGS_flash_attn_version=3" in msg) == fa3
    assert f"fall back to FA{3 if fa3 else 2} with a warning" in msg
    if capability == (10, 0):
        assert "needs an SM100" not in msg


def test_one_policy_resolution_names_its_origin(clean_env) -> None:
    """Issue 27, defect 1: config > FLASHCP_FA4_UNAVAILABLE > error, resolved in one place;
    each refusal and each fallback names where the policy came from and how to change it."""
    Policy = fa_dispatch.Policy
    assert fa_dispatch.resolve_policy() == Policy("error", "default")
    clean_env.setenv(fa_dispatch.ENV_FA4_POLICY, " fallback ")
    assert fa_dispatch.resolve_policy() == Policy("fallback", "environment")
    assert fa_dispatch.resolve_policy("error") == Policy("error", "config")  # the config wins
    given = Policy("fallback", "config")
    assert fa_dispatch.resolve_policy(given) is given  # resolved once, then passed along
    flag = fa_dispatch.resolve_policy("error", source="--fa4-unavailable")
    assert (flag.origin, flag.how_to_fallback) == (
        "--fa4-unavailable error", "pass --fa4-unavailable fallback"
    )
    cases = {
        "config": ("attention.fa4_unavailable: error", "set attention.fa4_unavailable: fallback"),
        "environment": ("FLASHCP_FA4_UNAVAILABLE=error",
                        "set FLASHCP_FA4_UNAVAILABLE=fallback (or attention.fa4_unavailable: "
                        "fallback)"),
        "default": ("the default, neither attention.fa4_unavailable nor "
                    "FLASHCP_FA4_UNAVAILABLE being set",
                    "set FLASHCP_FA4_UNAVAILABLE=fallback (or attention.fa4_unavailable: "
                    "fallback)"),
        "argument": ("fa4_unavailable='error'", "pass fa4_unavailable='fallback'"),
    }  # fmt: skip
    kwargs = _kwargs("N", "N", "Y", "N", 64)
    for source, (origin, way_out) in cases.items():
        policy = Policy("error", source)
        assert (policy.origin, policy.how_to_fallback) == (origin, way_out)
        for requested in (3, 4):
            with pytest.raises(FlashAttnUnavailableError) as info:
                explain_fa_version(requested, fa4_unavailable=policy, **kwargs)
            assert f"from {origin})" in str(info.value) and way_out in str(info.value)
        res = explain_fa_version(4, fa4_unavailable=Policy("fallback", source), **kwargs)
        fallback = Policy("fallback", source).origin
        assert res.version == 2 and res.reason.count(f"(policy 'fallback', from {fallback})") == 2
    for source, name in (("environment", "FLASHCP_FA4_UNAVAILABLE"),
                         ("config", "attention.fa4_unavailable"), ("argument", "fa4_unavailable")):
        with pytest.raises(ValueError, match=f"{name}='sometimes' is not a policy"):
            Policy("sometimes", source)  # fmt: skip


# Call shapes (mask [B, Hm, Sk, C], KV heads, head_dim, value head_dim) against the SM100 CuTe
# kernel's limits, as upstream's `_is_cutedsl_kernel_supported` and the mask-head assertion of
# its `flashmask_attention` decide them (PaddlePaddle/flash-attention
# flashmask/flash_mask/cute/interface.py @ 9985af538d20bd7a56c7a5f5ea13294d454a011a).
# The last column: None = supported, else a word the reason must contain.
FA4_LIMITS = [
    (None, 2, 128, None, None),  # no mask
    ((2, 1, 64, 1), 2, 128, None, None),  # causal 1-column, broadcast heads
    ((2, 1, 64, 2), 2, 128, None, None),  # 2 columns
    ((2, 2, 64, 2), 2, 64, None, None),  # one mask head per KV head
    ((2, 1, 64, 4), 2, 128, None, "4-column"),  # 4 columns: upstream sends these to FA2/FA3
    ((2, 4, 64, 4), 2, 128, None, "4-column"),
    ((2, 4, 64, 2), 2, 128, None, "4 mask heads"),  # Hm = Hq != Hkv
    ((2, 3, 64, 1), 8, 128, None, "3 mask heads"),
    ((2, 8, 64, 1), 8, 128, None, None),  # Hm = Hkv = 8
    (None, 2, 192, 128, None),  # 192 / 128
    (None, 2, 192, None, "head_dim 192"),  # 192 / 192
    (None, 2, 256, 256, None),
    (None, 2, 512, 512, None),
    (None, 2, 576, 512, None),
    (None, 2, 160, 160, "head_dim 160"),
    ((1, 1, 8, 2), 1, 96, 96, None),  # any head_dim <= 128
]


@pytest.mark.parametrize(("mask", "kv", "hd", "hdv", "why"), FA4_LIMITS)
def test_fa4_call_limit(mask, kv, hd, hdv, why) -> None:
    got = fa_dispatch.fa4_call_limit(mask_shape=mask, num_kv_heads=kv, head_dim=hd, head_dim_v=hdv)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got


# ----------------------------------------------------------------------- probe


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch):
    flags = (fa_dispatch.FLAG_VERSION, fa_dispatch.FLAG_DETERMINISTIC, fa_dispatch.ENV_FA4_POLICY)
    for key in flags:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_probe_defaults_on_cpu(clean_env) -> None:
    inputs = fa_dispatch.probe_inputs()
    assert inputs.requested == 2
    assert inputs.deterministic is False
    assert inputs.fa4_available is False
    assert inputs.fa4_unavailable == "error"
    assert inputs.device.startswith("cpu")
    assert inputs.block_mask_api is True  # paddle 3.3.1's flashmask_attention takes block_mask
    assert inputs.sources[fa_dispatch.FLAG_VERSION] == "default"
    assert inputs.fa3_available is False and inputs.capability is None
    assert inputs.sources["fa3_available"] == "no CUDA device"
    # a stand-in capability (explain-dispatch --capability) rehearses a card's dispatch
    hopper = fa_dispatch.probe_inputs(capability=(9, 0))
    assert (hopper.fa3_available, hopper.fa4_available, hopper.capability) == (True, False, (9, 0))
    assert hopper.sources["capability"] == "argument"


def test_probe_reads_environment(clean_env) -> None:
    clean_env.setenv(fa_dispatch.FLAG_VERSION, "3")
    clean_env.setenv(fa_dispatch.FLAG_DETERMINISTIC, "true")
    clean_env.setenv(fa_dispatch.ENV_FA4_POLICY, "fallback")
    inputs = fa_dispatch.probe_inputs()
    assert (inputs.requested, inputs.deterministic, inputs.fa4_unavailable) == (3, True, "fallback")
    assert inputs.sources[fa_dispatch.FLAG_VERSION] == "environment"
    assert inputs.sources["fa4_unavailable"] == "environment"
    # An explicit config policy wins over the environment.
    assert fa_dispatch.probe_inputs(policy="error").fa4_unavailable == "error"
    assert fa_dispatch.probe_inputs(deterministic=False).deterministic is False


def test_probe_rejects_garbage(clean_env) -> None:
    clean_env.setenv(fa_dispatch.FLAG_VERSION, "three")
    with pytest.raises(ValueError, match="FLAGS_flash_attn_version='three'"):
        fa_dispatch.probe_inputs()
    clean_env.setenv(fa_dispatch.FLAG_VERSION, "3")
    clean_env.setenv(fa_dispatch.FLAG_DETERMINISTIC, "maybe")
    with pytest.raises(ValueError, match="FLAGS_cudnn_deterministic"):
        fa_dispatch.probe_inputs()
    clean_env.setenv(fa_dispatch.FLAG_DETERMINISTIC, "0")
    clean_env.setenv(fa_dispatch.ENV_FA4_POLICY, "sometimes")
    with pytest.raises(ValueError, match="FLASHCP_FA4_UNAVAILABLE"):
        fa_dispatch.probe_inputs()


def test_read_flag_prefers_paddle_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    import paddle

    monkeypatch.setattr(paddle, "get_flags", lambda names: {names[0]: 3})
    monkeypatch.setenv(fa_dispatch.FLAG_VERSION, "2")
    assert fa_dispatch.probe_requested_version() == (3, "paddle.get_flags")


def test_resolve_current_on_cpu(clean_env, caplog: pytest.LogCaptureFixture) -> None:
    reset_once("dispatch:")
    with caplog.at_level(logging.INFO, logger="flashcp"):
        assert fa_dispatch.resolve_current(64).version == 2
        assert fa_dispatch.resolve_current(64).version == 2
    assert sum("fa_version=2" in r.getMessage() for r in caplog.records) == 1
    clean_env.setenv(fa_dispatch.FLAG_VERSION, "4")
    with pytest.raises(FlashAttnUnavailableError):
        fa_dispatch.resolve_current(64)
    res = fa_dispatch.resolve_current(64, policy="fallback")  # no FA4, no FA3 without a card
    assert res.version == 2 and "FA3 unavailable" in res.reason
    clean_env.setenv(fa_dispatch.FLAG_VERSION, "3")
    with pytest.raises(FlashAttnUnavailableError, match="SM90"):
        fa_dispatch.resolve_current(64)


def _pretend_card(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], cute: bool):
    monkeypatch.setattr(fa_dispatch, "probe_capability", lambda: capability)
    monkeypatch.setattr(fa_dispatch, "_probe_cute", lambda: (cute, "test"))


def test_resolve_current_checks_the_call_against_fa4_limits(
    clean_env, caplog: pytest.LogCaptureFixture
) -> None:
    """On an SM100 card with CuTe, a 4-column or Hq-head mask makes FA4 unavailable per call."""
    _pretend_card(clean_env, (10, 0), True)
    clean_env.setenv(fa_dispatch.FLAG_VERSION, "4")
    reset_once("dispatch:")
    ok = fa_dispatch.resolve_current(64, mask_shape=(1, 1, 32, 2), num_kv_heads=2)
    assert ok.version == 4
    with pytest.raises(FlashAttnUnavailableError, match="4-column"):
        fa_dispatch.resolve_current(64, mask_shape=(1, 1, 32, 4), num_kv_heads=2)
    with caplog.at_level(logging.WARNING, logger="flashcp"):
        for _ in range(2):
            res = fa_dispatch.resolve_current(
                64, policy="fallback", mask_shape=(1, 4, 32, 2), num_kv_heads=2
            )
            # SM100 has no FA3 either: FA4 -> 3 -> 2
            assert res.version == 2 and "4 mask heads" in res.reason
    assert sum("4 mask heads" in r.getMessage() for r in caplog.records) == 1
    # the check applies only when FA4 is asked for, and only with the call's shape given
    assert fa_dispatch.resolve_current(64, mask_shape=(1, 1, 32, 4)).version == 4
    clean_env.setenv(fa_dispatch.FLAG_VERSION, "2")
    assert fa_dispatch.resolve_current(64, mask_shape=(1, 1, 32, 4), num_kv_heads=2).version == 2


def test_block_mask_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    import paddle.nn.functional as F

    fa_dispatch.probe_block_mask_api.cache_clear()
    monkeypatch.setattr(F, "flashmask_attention", lambda q, k, v, startend_row_indices=None: q)
    assert fa_dispatch.probe_block_mask_api() is False
    fa_dispatch.probe_block_mask_api.cache_clear()
    monkeypatch.delattr(F, "flashmask_attention")
    assert fa_dispatch.probe_block_mask_api() is False
    fa_dispatch.probe_block_mask_api.cache_clear()


class _FakeCuda:
    def __init__(self, count: int, major: int) -> None:
        self.count, self.major = count, major

    def device_count(self) -> int:
        return self.count

    def get_device_capability(self) -> tuple[int, int]:
        return (self.major, 0)


@pytest.fixture
def fresh_probes():
    fa_dispatch.clear_probe_caches()
    yield
    fa_dispatch.clear_probe_caches()


@pytest.mark.parametrize(
    ("compiled", "count", "major", "importable", "fa3", "fa4", "detail"),
    [
        (False, 0, 0, True, False, False, "no CUDA device"),
        (True, 0, 9, True, False, False, "no CUDA device"),
        (True, 1, 8, True, False, False, "SM80 (compute capability 8.0): FA4 needs SM100"),
        (True, 1, 9, True, True, False, "SM90 (compute capability 9.0): FA4 needs SM100"),
        (True, 1, 10, False, False, False, "import failed"),
        (True, 1, 10, True, False, True, "SM100 (compute capability 10.0), CuTe"),
        (True, 1, 12, True, False, False, "SM120"),
    ],
)
def test_capability_probes(
    monkeypatch, fresh_probes, compiled, count, major, importable, fa3, fa4, detail
) -> None:
    import sys
    import types

    import paddle

    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: compiled)
    monkeypatch.setattr(paddle.device, "cuda", _FakeCuda(count, major))
    if importable:
        iface = types.ModuleType(fa_dispatch.CUTE_INTERFACE_MODULE)
        iface._flash_attn_fwd = lambda *a, **k: None
        iface._flash_attn_bwd = lambda *a, **k: None
        utils = types.ModuleType(fa_dispatch.CUTE_UTILS_MODULE)
        utils.FlashMaskInfoPaddle = object
        monkeypatch.setitem(sys.modules, fa_dispatch.CUTE_INTERFACE_MODULE, iface)
        monkeypatch.setitem(sys.modules, fa_dispatch.CUTE_UTILS_MODULE, utils)
    else:
        monkeypatch.setitem(sys.modules, fa_dispatch.CUTE_INTERFACE_MODULE, None)
    ok4, why4 = fa_dispatch.probe_fa4()
    ok3, why3 = fa_dispatch.probe_fa3()
    assert ok4 is fa4 and detail in why4
    assert ok3 is fa3
    assert ("SM90" in why3) if count and compiled else why3 == "no CUDA device"
    inputs = fa_dispatch.probe_inputs()
    assert (inputs.fa3_available, inputs.fa4_available) == (fa3, fa4)
    want_cap = (major, 0) if compiled and count else None
    assert inputs.capability == want_cap


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
    # Issue 13: FA3 requested on an SM80/SM100 card reaches the op.
    "FA3 availability ignored": (
        "if version == 3 and not fa3_available:",
        "if version == 3 and fa3_available is None:",
    ),
    # The #1396 pattern again: FA3 availability checked on the raw flag, so FA4 -> 3 on a card
    # without FA3 still runs FA3.
    "FA3 check keyed on raw flag": (
        "if version == 3 and not fa3_available:",
        "if requested == 3 and not fa3_available:",
    ),
    "FA3 fallback keeps 3": (
        "        version = 2\n        rules.append(f\"FA3 unavailable",
        "        version = 3\n        rules.append(f\"FA3 unavailable",
    ),
    "FA4 call limit ignored": (
        "fa4_usable = fa4_available and fa4_limit is None",
        "fa4_usable = fa4_available",
    ),
    "4-column masks let through": ("if columns == 4:", "if columns > 4:"),
    "Hq mask heads let through": (
        "if heads not in (1, num_kv_heads):",
        "if heads not in (1, num_kv_heads, heads):",
    ),
    "FA4 head dims unchecked": (
        "if not (max(head_dim, dv) <= 128 or",
        "if False and not (max(head_dim, dv) <= 128 or",
    ),
}


def _table_failures(module) -> int:
    """Rows where `module`'s rule disagrees with the written-out tables (both policies, the
    per-call FA4 limits, plus XPU)."""
    resolve = module.resolve_fa_version
    bad = 0
    for _, req, fa3, fa4, bm, det, hd, fallback, error in TABLE:
        for policy, expected in (("fallback", fallback), ("error", error)):
            try:
                got = resolve(req, fa4_unavailable=policy, **_kwargs(fa3, fa4, bm, det, hd))
            except NotImplementedError as exc:
                got = R4 if "FA4" in str(exc).split(",")[0] else R3
            bad += got != expected
    for req in (2, 3, 4):
        try:
            got = resolve(
                req,
                fa4_available=True,
                fa3_available=False,
                block_mask_api=True,
                deterministic=False,
                head_dim=64,
                device="xpu:0",
            )
        except NotImplementedError:
            got = R3
        bad += got != 2
    for mask, kv, hd, hdv, why in FA4_LIMITS:
        got = module.fa4_call_limit(mask_shape=mask, num_kv_heads=kv, head_dim=hd, head_dim_v=hdv)
        bad += (got is None) != (why is None)
    return bad


def test_real_rule_passes_the_table() -> None:
    assert _table_failures(fa_dispatch) == 0


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_broken_rule_fails_the_table(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deliberately broken dispatch rule is caught by the table (the suite would go red)."""
    import inspect
    import sys
    import types

    old, new = MUTANTS[name]
    source = inspect.getsource(fa_dispatch)
    assert source.count(old) >= 1, f"mutation site for {name!r} no longer exists"
    mutant = types.ModuleType("flashcp_dispatch_mutant")
    monkeypatch.setitem(sys.modules, mutant.__name__, mutant)  # dataclasses look it up
    exec(compile(source.replace(old, new, 1), "<mutant>", "exec"), mutant.__dict__)
    assert _table_failures(mutant) > 0, f"mutant {name!r} survived"
