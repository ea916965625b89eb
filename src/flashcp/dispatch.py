"""Which FlashAttention kernel family (FA2, FA3, FA4) runs: one pure rule plus one probe.

The rule fixes the PaddleFleet PR #1396 bug: the *effective* version is computed once
(unavailable FA4 is refused or normalised to 3, then the deterministic downgrade is applied to
that effective value) and the caller hands this one value to both forward and backward.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
from dataclasses import dataclass, field

from flashcp.log import log_once

FA_VERSIONS = (2, 3, 4)
FA4_POLICIES = ("error", "fallback")
FLAG_VERSION = "FLAGS_flash_attn_version"
FLAG_DETERMINISTIC = "FLAGS_cudnn_deterministic"
ENV_FA4_POLICY = "FLASHCP_FA4_UNAVAILABLE"
DEFAULT_FA_VERSION = 2  # Paddle's own default for FLAGS_flash_attn_version
DETERMINISTIC_MAX_HEAD_DIM = 128

# The CuTe-DSL FlashMask kernels ("FA4"), SM100 only.
CUTE_INTERFACE_MODULE = "paddlefleet_ops.flash_mask.cute.interface"
CUTE_UTILS_MODULE = "paddlefleet_ops.flash_mask.cute.flashmask_utils"


class FlashAttnUnavailableError(NotImplementedError):
    """The requested FlashAttention version has no backend on this machine."""


@dataclass(frozen=True)
class Resolution:
    """The effective version and the rules that produced it, in order."""

    requested: int
    version: int
    rules: tuple[str, ...]

    @property
    def reason(self) -> str:
        return "; ".join(self.rules)


def _check_policy(fa4_unavailable: str) -> None:
    if fa4_unavailable not in FA4_POLICIES:
        raise ValueError(
            f"fa4_unavailable={fa4_unavailable!r} is not a policy: use one of "
            f"{', '.join(FA4_POLICIES)} (config key `attention.fa4_unavailable` or env "
            f"{ENV_FA4_POLICY})."
        )


def explain_fa_version(
    requested: int,
    *,
    fa4_available: bool,
    block_mask_api: bool,
    deterministic: bool,
    head_dim: int,
    device: str = "gpu",
    fa4_unavailable: str = "error",
) -> Resolution:
    """Resolve the effective FA version and say which rule fired (see `resolve_fa_version`)."""
    if (
        isinstance(requested, bool)
        or not isinstance(requested, int)
        or requested not in FA_VERSIONS
    ):
        raise ValueError(
            f"{FLAG_VERSION}={requested!r} is not a FlashAttention version: set it to 2, 3 or 4."
        )
    _check_policy(fa4_unavailable)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim={head_dim!r} must be a positive int (q.shape[-1]).")

    if "xpu" in device.lower():
        return Resolution(requested, 2, (f"device {device!r} is XPU: only FA2 exists there",))

    rules: list[str] = []
    version = requested
    if version == 4 and not fa4_available:
        if fa4_unavailable == "error":
            raise FlashAttnUnavailableError(
                f"{FLAG_VERSION}=4 asks for FA4, which needs the CuTe FlashMask backend "
                f"({CUTE_INTERFACE_MODULE}) on an SM100 GPU, and it is not available here. "
                f"Set {FLAG_VERSION} to 3 or 2 on this card (or {ENV_FA4_POLICY}=fallback "
                "to fall back to FA3 with a warning)."
            )
        log_once(
            "dispatch:fa4-fallback",
            "FA4 requested but the CuTe backend is unavailable: falling back to FA3 "
            f"({ENV_FA4_POLICY}=fallback)",
            level=logging.WARNING,
            rank0_only=False,
        )
        version = 3
        rules.append("FA4 requested but unavailable: normalised to 3 (policy 'fallback')")
    else:
        rules.append(f"requested {requested}")

    if version == 3 and deterministic:
        if not block_mask_api:
            version = 2
            rules.append(
                "deterministic and this Paddle's flashmask_attention has no block_mask "
                "(no deterministic FA3 backward): downgraded to 2"
            )
        elif head_dim > DETERMINISTIC_MAX_HEAD_DIM:
            version = 2
            rules.append(
                f"deterministic FA3 supports head_dim <= {DETERMINISTIC_MAX_HEAD_DIM}, "
                f"got {head_dim}: downgraded to 2"
            )
    return Resolution(requested, version, tuple(rules))


def resolve_fa_version(
    requested: int,
    *,
    fa4_available: bool,
    block_mask_api: bool,
    deterministic: bool,
    head_dim: int,
    device: str = "gpu",
    fa4_unavailable: str = "error",
) -> int:
    """The effective FlashAttention version; pass the same value to forward and backward.

    XPU → 2. Requested must be 2, 3 or 4. FA4 without its backend raises
    `FlashAttnUnavailableError` (policy "error") or becomes 3 (policy "fallback"). An effective
    3 is downgraded to 2 when deterministic and (no `block_mask` API or head_dim > 128).
    """
    return explain_fa_version(
        requested,
        fa4_available=fa4_available,
        block_mask_api=block_mask_api,
        deterministic=deterministic,
        head_dim=head_dim,
        device=device,
        fa4_unavailable=fa4_unavailable,
    ).version


# --------------------------------------------------------------------------- probe


@dataclass(frozen=True)
class DispatchInputs:
    """Everything the rule reads from the environment, with where each value came from."""

    requested: int
    fa4_available: bool
    block_mask_api: bool
    deterministic: bool
    device: str
    fa4_unavailable: str
    sources: dict[str, str] = field(default_factory=dict)


def _read_flag(name: str) -> tuple[str | None, str]:
    """A Paddle flag's raw value and its source: Paddle's registry, else the environment."""
    import paddle

    try:
        return str(paddle.get_flags([name])[name]), "paddle.get_flags"
    except (ValueError, KeyError):
        pass
    if name in os.environ:
        return os.environ[name], "environment"
    return None, "default"


def parse_bool(raw: str, *, key: str) -> bool:
    """Parse a flag-style boolean ("1", "true", "0", "false", ...)."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{key}={raw!r} is not a boolean: use 1 or 0.")


def probe_requested_version() -> tuple[int, str]:
    raw, source = _read_flag(FLAG_VERSION)
    if raw is None:
        return DEFAULT_FA_VERSION, source
    try:
        return int(raw.strip()), source
    except ValueError:
        raise ValueError(
            f"{FLAG_VERSION}={raw!r} is not an integer: set it to 2, 3 or 4."
        ) from None


def probe_deterministic() -> tuple[bool, str]:
    raw, source = _read_flag(FLAG_DETERMINISTIC)
    if raw is None:
        return False, source
    return parse_bool(raw, key=FLAG_DETERMINISTIC), source


@functools.cache
def probe_block_mask_api() -> bool:
    """Whether this Paddle's `flashmask_attention` takes `block_mask` (Paddle PR #76729)."""
    import paddle.nn.functional as F

    fn = getattr(F, "flashmask_attention", None)
    if fn is None:
        return False
    return "block_mask" in inspect.signature(fn).parameters


def import_cute_fa4() -> tuple[object, object, object]:
    """Import the CuTe FA4 entry points: (_flash_attn_fwd, _flash_attn_bwd, FlashMaskInfoPaddle)."""
    interface = importlib.import_module(CUTE_INTERFACE_MODULE)
    utils = importlib.import_module(CUTE_UTILS_MODULE)
    return interface._flash_attn_fwd, interface._flash_attn_bwd, utils.FlashMaskInfoPaddle


@functools.cache
def probe_fa4() -> tuple[bool, str]:
    """FA4 is available on a CUDA device of capability major 10 whose CuTe import succeeds."""
    import paddle

    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        return False, "no CUDA device"
    major = paddle.device.cuda.get_device_capability()[0]
    if major != 10:
        return False, f"CUDA capability major {major} (FA4 needs 10, SM100)"
    try:
        import_cute_fa4()
    except (ImportError, AttributeError) as exc:
        return False, f"CuTe FlashMask import failed: {exc}"
    return True, "SM100 and CuTe FlashMask importable"


def resolve_policy(policy: str | None = None) -> tuple[str, str]:
    """The FA4-unavailable policy: explicit (config) > FLASHCP_FA4_UNAVAILABLE > "error"."""
    if policy is not None:
        _check_policy(policy)
        return policy, "config"
    env = os.environ.get(ENV_FA4_POLICY)
    if env is not None:
        _check_policy(env.strip())
        return env.strip(), "environment"
    return "error", "default"


def probe_inputs(*, policy: str | None = None, deterministic: bool | None = None) -> DispatchInputs:
    """Gather the rule's inputs from Paddle and the environment."""
    import paddle

    requested, req_src = probe_requested_version()
    if deterministic is None:
        deterministic, det_src = probe_deterministic()
    else:
        det_src = "argument"
    fa4, fa4_src = probe_fa4()
    pol, pol_src = resolve_policy(policy)
    return DispatchInputs(
        requested=requested,
        fa4_available=fa4,
        block_mask_api=probe_block_mask_api(),
        deterministic=deterministic,
        device=paddle.get_device(),
        fa4_unavailable=pol,
        sources={
            FLAG_VERSION: req_src,
            FLAG_DETERMINISTIC: det_src,
            "fa4_available": fa4_src,
            "fa4_unavailable": pol_src,
            "block_mask_api": "inspect.signature(paddle.nn.functional.flashmask_attention)",
            "device": "paddle.get_device()",
        },
    )


def resolve_from_inputs(inputs: DispatchInputs, head_dim: int) -> Resolution:
    """Apply the rule to probed inputs and log the outcome once per process on rank 0."""
    res = explain_fa_version(
        inputs.requested,
        fa4_available=inputs.fa4_available,
        block_mask_api=inputs.block_mask_api,
        deterministic=inputs.deterministic,
        head_dim=head_dim,
        device=inputs.device,
        fa4_unavailable=inputs.fa4_unavailable,
    )
    log_once(
        f"dispatch:{res.requested}:{res.version}:{res.reason}",
        f"fa_version={res.version} (requested {res.requested}, head_dim {head_dim}): {res.reason}",
    )
    return res


def resolve_current(head_dim: int, *, policy: str | None = None) -> Resolution:
    """Probe the environment and resolve: what an attention forward calls, once per call."""
    return resolve_from_inputs(probe_inputs(policy=policy), head_dim)
