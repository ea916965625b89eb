"""Which FlashAttention kernel family (FA2, FA3, FA4) runs: one pure rule plus one probe.

The rule fixes the PaddleFleet PR #1396 bug: the *effective* version is computed once
(unavailable FA4 is refused or normalised to 3, an unavailable FA3 is refused or normalised to
2, then the deterministic downgrade is applied to that effective value) and the caller hands
this one value to both forward and backward.

Availability is per card and per call: FA3 kernels exist for SM90 (Hopper) only ("FlashAttention-3
only supports Hopper GPUs"); FA4 needs SM100 and the CuTe kernels, and upstream's own CuTe
wrapper refuses some masks (`fa4_call_limit`), which makes FA4 unavailable for that call.
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
CONFIG_POLICY_KEY = "attention.fa4_unavailable"
DEFAULT_FA_VERSION = 2  # Paddle's own default for FLAGS_flash_attn_version
DETERMINISTIC_MAX_HEAD_DIM = 128
FA3_CAPABILITY_MAJOR = 9  # FA3 kernels: SM90 (Hopper) only
FA4_CAPABILITY_MAJOR = 10  # CuTe FA4 kernels: SM100 (Blackwell B200/B300) only

# The CuTe-DSL FlashMask kernels ("FA4"), SM100 only.
CUTE_INTERFACE_MODULE = "paddlefleet_ops.flash_mask.cute.interface"
CUTE_UTILS_MODULE = "paddlefleet_ops.flash_mask.cute.flashmask_utils"


class FlashAttnUnavailableError(NotImplementedError):
    """The requested FlashAttention version has no backend on this machine (or for this call)."""


def capability_text(capability: tuple[int, int] | None) -> str:
    """`SM80 (compute capability 8.0)`, or "no CUDA device" when there is no card."""
    if capability is None:
        return "no CUDA device (compute capability: none)"
    major, minor = capability
    return f"SM{major}{minor} (compute capability {major}.{minor})"


@dataclass(frozen=True)
class Resolution:
    """The effective version and the rules that produced it, in order."""

    requested: int
    version: int
    rules: tuple[str, ...]

    @property
    def reason(self) -> str:
        return "; ".join(self.rules)


def _check_policy(fa4_unavailable: str, name: str = "fa4_unavailable") -> None:
    if fa4_unavailable not in FA4_POLICIES:
        raise ValueError(
            f"{name}={fa4_unavailable!r} is not a policy: use one of "
            f"{', '.join(FA4_POLICIES)} (config key `{CONFIG_POLICY_KEY}` or env "
            f"{ENV_FA4_POLICY})."
        )


@dataclass(frozen=True)
class Policy:
    """The FA4-unavailable policy ("error" or "fallback") and where it was set: `source` is
    "config" (`attention.fa4_unavailable`), "environment" (`FLASHCP_FA4_UNAVAILABLE`),
    "default" (neither set), "argument" (a library call's `fa4_unavailable=`) or the
    command-line flag that gave it (`--fa4-unavailable`). `resolve_policy` makes one."""

    value: str
    source: str = "argument"

    def __post_init__(self) -> None:
        names = {"config": CONFIG_POLICY_KEY, "environment": ENV_FA4_POLICY}
        _check_policy(self.value, names.get(self.source, "fa4_unavailable"))

    @property
    def origin(self) -> str:
        """Where the policy came from, as messages name it."""
        if self.source == "config":
            return f"{CONFIG_POLICY_KEY}: {self.value}"
        if self.source == "environment":
            return f"{ENV_FA4_POLICY}={self.value}"
        if self.source == "default":
            return f"the default, neither {CONFIG_POLICY_KEY} nor {ENV_FA4_POLICY} being set"
        if self.source == "argument":
            return f"fa4_unavailable={self.value!r}"
        return f"{self.source} {self.value}"

    @property
    def how_to_fallback(self) -> str:
        """What to set to fall back instead (the config's policy wins over the environment)."""
        if self.source == "config":
            return f"set {CONFIG_POLICY_KEY}: fallback"
        if self.source in ("environment", "default"):
            return f"set {ENV_FA4_POLICY}=fallback (or {CONFIG_POLICY_KEY}: fallback)"
        if self.source == "argument":
            return "pass fa4_unavailable='fallback'"
        return f"pass {self.source} fallback"


def _fa4_missing(
    capability: tuple[int, int] | None, fa4_available: bool, fa4_limit: str | None
) -> str:
    """Why FA4 cannot run: what this machine (or this call) lacks."""
    if fa4_available:
        return f"this call is beyond the SM100 CuTe kernel: {fa4_limit}"
    kernels = f"the paddlefleet_ops CuTe FlashMask kernels ({CUTE_INTERFACE_MODULE})"
    if capability is not None and capability[0] == FA4_CAPABILITY_MAJOR:
        why = (
            f"it needs {kernels}, which this {capability_text(capability)} card does not "
            "have (their wheel is not on PyPI: install paddlefleet_ops)"
        )
    else:
        have = (
            "this machine has no CUDA device"
            if capability is None
            else f"this card is {capability_text(capability)}"
        )
        why = f"it needs an SM{FA4_CAPABILITY_MAJOR}0 GPU with {kernels}, and {have}"
    return why + ("" if fa4_limit is None else f"; also {fa4_limit}")


def _fa3_missing(capability: tuple[int, int] | None) -> str:
    """Why FA3 cannot run on this machine."""
    return (
        f"FA3 kernels exist for SM{FA3_CAPABILITY_MAJOR}0 (Hopper) only and this machine "
        f"has {capability_text(capability)}"
    )


def _runnable_here(fa3_available: bool, capability: tuple[int, int] | None) -> str:
    """The FlashAttention versions this card runs, as the setting to choose one."""
    if fa3_available:
        return f"Set {FLAG_VERSION}=3 (FA3 runs on this {capability_text(capability)} card) or 2"
    return (
        f"Set {FLAG_VERSION}=2 (FA2, Paddle's default): FA3 is unavailable too ("
        f"{_fa3_missing(capability)})"
    )


def explain_fa_version(
    requested: int,
    *,
    fa4_available: bool,
    block_mask_api: bool,
    deterministic: bool,
    head_dim: int,
    device: str = "gpu",
    fa4_unavailable: str | Policy = "error",
    fa3_available: bool = True,
    capability: tuple[int, int] | None = None,
    fa4_limit: str | None = None,
) -> Resolution:
    """Resolve the effective FA version and say which rule fired (see `resolve_fa_version`).

    `capability` (the card's compute capability) and `fa4_limit` (why this call's mask is
    beyond the CuTe kernel, from `fa4_call_limit`) only feed the messages, except that a
    `fa4_limit` makes FA4 unavailable for this call like `fa4_available=False`.
    `fa4_unavailable` is the policy, a `Policy` (which names where it was set in every
    message) or its bare value.
    """
    if (
        isinstance(requested, bool)
        or not isinstance(requested, int)
        or requested not in FA_VERSIONS
    ):
        raise ValueError(
            f"{FLAG_VERSION}={requested!r} is not a FlashAttention version: set it to 2, 3 or 4."
        )
    policy = fa4_unavailable if isinstance(fa4_unavailable, Policy) else Policy(fa4_unavailable)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim={head_dim!r} must be a positive int (q.shape[-1]).")

    if "xpu" in device.lower():
        return Resolution(requested, 2, (f"device {device!r} is XPU: only FA2 exists there",))

    rules: list[str] = []
    version = requested
    fa4_usable = fa4_available and fa4_limit is None
    if version == 4 and not fa4_usable:
        why = _fa4_missing(capability, fa4_available, fa4_limit)
        if policy.value == "error":
            raise FlashAttnUnavailableError(
                f"{FLAG_VERSION}=4 asks for FA4, which is unavailable: {why}. "
                f"{_runnable_here(fa3_available, capability)}; or {policy.how_to_fallback} to "
                f"fall back to FA{3 if fa3_available else 2} with a warning (the policy is "
                f"'error', from {policy.origin})."
            )
        log_once(
            f"dispatch:fa4-fallback:{fa4_limit or ''}",
            f"FA4 requested but unavailable ({why}): falling back to FA3 (policy 'fallback', "
            f"from {policy.origin})",
            level=logging.WARNING,
            rank0_only=False,
        )
        version = 3
        rules.append(
            f"FA4 requested but unavailable ({why}): normalised to 3 (policy 'fallback', from "
            f"{policy.origin})"
        )
    else:
        rules.append(f"requested {requested}")

    if version == 3 and not fa3_available:
        why = _fa3_missing(capability)
        if policy.value == "error":
            raise FlashAttnUnavailableError(
                f"{FLAG_VERSION}={requested} asks for FA3 (effective version 3), which is "
                f"unavailable: {why}. Set {FLAG_VERSION}=2 on this card; or "
                f"{policy.how_to_fallback} to fall back to FA2 with a warning (the policy is "
                f"'error', from {policy.origin})."
            )
        log_once(
            "dispatch:fa3-fallback",
            f"FA3 unavailable ({why}): falling back to FA2 (policy 'fallback', from "
            f"{policy.origin})",
            level=logging.WARNING,
            rank0_only=False,
        )
        version = 2
        rules.append(f"FA3 unavailable ({why}): normalised to 2 (policy 'fallback', from "
                     f"{policy.origin})")  # fmt: skip

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
    fa4_unavailable: str | Policy = "error",
    fa3_available: bool = True,
    capability: tuple[int, int] | None = None,
    fa4_limit: str | None = None,
) -> int:
    """The effective FlashAttention version; pass the same value to forward and backward.

    XPU → 2. Requested must be 2, 3 or 4. FA4 without its backend (or with a `fa4_limit` for
    this call) raises `FlashAttnUnavailableError` (policy "error") or becomes 3 (policy
    "fallback"). An effective 3 without FA3 (not SM90) raises under "error" or becomes 2
    under "fallback". An effective 3 is then downgraded to 2 when deterministic and (no
    `block_mask` API or head_dim > 128).
    """
    return explain_fa_version(
        requested,
        fa4_available=fa4_available,
        block_mask_api=block_mask_api,
        deterministic=deterministic,
        head_dim=head_dim,
        device=device,
        fa4_unavailable=fa4_unavailable,
        fa3_available=fa3_available,
        capability=capability,
        fa4_limit=fa4_limit,
    ).version


# ------------------------------------------------------------------- per-call FA4 limits

# The CuTe FA4 wrapper's own support check, mirrored (PaddlePaddle/flash-attention
# `flashmask/flash_mask/cute/interface.py` at 9985af538d20bd7a56c7a5f5ea13294d454a011a:
# `_is_cutedsl_kernel_supported` / `_is_valid_flash_dims` / `_is_non_4vec_startend`, and the
# `startend_row_indices.shape[1] in [1, key.shape[2]]` assertion of its `flashmask_attention`).
# flashcp calls the private `_flash_attn_fwd/_bwd` directly, which skips that check.
FA4_HEAD_DIMS: tuple[tuple[int, int], ...] = ((192, 128), (256, 256), (512, 512), (576, 512))
"""(q/k head_dim, v head_dim) pairs above 128 the SM100 kernels take (all of <= 128 work)."""


def fa4_call_limit(
    *,
    mask_shape: tuple[int, ...] | None,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int | None = None,
) -> str | None:
    """Why the SM100 CuTe kernel cannot run this call, or None when it can.

    `mask_shape` is the `startend_row_indices` shape `[B, Hm, Sk, C]` handed to the kernel
    (under CP: the rebased local mask) or None. Upstream sends 4-column masks to FA2/FA3
    instead, and refuses mask head counts other than 1 and the number of KV heads.
    """
    dv = head_dim if head_dim_v is None else head_dim_v
    if not (max(head_dim, dv) <= 128 or (head_dim, dv) in FA4_HEAD_DIMS):
        return (
            f"head_dim {head_dim} / value head_dim {dv} (the SM100 kernels take <= 128 or "
            f"{', '.join(f'{a}/{b}' for a, b in FA4_HEAD_DIMS)})"
        )
    if mask_shape is None:
        return None
    heads, columns = int(mask_shape[1]), int(mask_shape[-1])
    if columns == 4:
        return (
            "a 4-column startend_row_indices (LTS, LTE, UTS, UTE; CP rebasing makes one from "
            "a causal 2-column mask), which the SM100 CuTe kernel does not support"
        )
    if heads not in (1, num_kv_heads):
        return (
            f"startend_row_indices has {heads} mask heads; the SM100 CuTe kernel takes 1 or "
            f"the number of KV heads ({num_kv_heads})"
        )
    return None


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
    fa3_available: bool = True
    capability: tuple[int, int] | None = None
    """The CUDA card's compute capability (major, minor), None without a CUDA device."""


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
def probe_capability() -> tuple[int, int] | None:
    """The current CUDA card's compute capability (major, minor); None without a CUDA device.

    Read with `paddle.device.cuda.get_device_capability()` (the current device).
    """
    import paddle

    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        return None
    major, minor = paddle.device.cuda.get_device_capability()
    return int(major), int(minor)


def probe_fa3(capability: tuple[int, int] | None = None) -> tuple[bool, str]:
    """FA3 is available on a CUDA device of capability major 9 (SM90, Hopper) only."""
    cap = probe_capability() if capability is None else capability
    if cap is None:
        return False, "no CUDA device"
    if cap[0] != FA3_CAPABILITY_MAJOR:
        return False, f"{capability_text(cap)}: FA3 needs SM90 (Hopper)"
    return True, capability_text(cap)


def probe_fa4(capability: tuple[int, int] | None = None) -> tuple[bool, str]:
    """FA4 is available on a CUDA device of capability major 10 whose CuTe import succeeds."""
    cap = probe_capability() if capability is None else capability
    if cap is None:
        return False, "no CUDA device"
    if cap[0] != FA4_CAPABILITY_MAJOR:
        return False, f"{capability_text(cap)}: FA4 needs SM100"
    ok, detail = _probe_cute()
    return ok, f"{capability_text(cap)}, {detail}"


@functools.cache
def _probe_cute() -> tuple[bool, str]:
    try:
        import_cute_fa4()
    except (ImportError, AttributeError) as exc:
        return False, f"CuTe FlashMask import failed: {exc}"
    return True, "CuTe FlashMask importable"


def clear_probe_caches() -> None:
    """Forget cached probes (capability, CuTe import, block_mask API); tests use this."""
    for fn in (probe_capability, _probe_cute, probe_block_mask_api):
        fn.cache_clear()


def resolve_policy(policy: str | Policy | None = None, *, source: str = "config") -> Policy:
    """THE resolution of the FA4-unavailable policy, for preflight, every rank and
    `flashcp explain-dispatch`: `policy` (the config's `attention.fa4_unavailable`, or what
    `source` names, e.g. `--fa4-unavailable`) > `FLASHCP_FA4_UNAVAILABLE` > "error". A
    `Policy` (resolved before) is kept as it is."""
    if isinstance(policy, Policy):
        return policy
    if policy is not None:
        return Policy(policy, source)
    env = os.environ.get(ENV_FA4_POLICY)
    if env is not None:
        return Policy(env.strip(), "environment")
    return Policy("error", "default")


def probe_inputs(
    *,
    policy: str | Policy | None = None,
    policy_source: str = "config",
    deterministic: bool | None = None,
    capability: tuple[int, int] | None = None,
) -> DispatchInputs:
    """Gather the rule's inputs from Paddle and the environment.

    `policy` / `policy_source`: see `resolve_policy`. `capability` stands in for the probed
    compute capability (`flashcp explain-dispatch --capability 9.0` rehearses a Hopper card's
    dispatch on any machine).
    """
    import paddle

    requested, req_src = probe_requested_version()
    if deterministic is None:
        deterministic, det_src = probe_deterministic()
    else:
        det_src = "argument"
    if capability is None:
        cap, cap_src = probe_capability(), "paddle.device.cuda.get_device_capability()"
        (fa3, fa3_src), (fa4, fa4_src) = probe_fa3(), probe_fa4()
    else:
        cap, cap_src = capability, "argument"
        (fa3, fa3_src), (fa4, fa4_src) = probe_fa3(cap), probe_fa4(cap)
    pol = resolve_policy(policy, source=policy_source)
    return DispatchInputs(
        requested=requested,
        fa4_available=fa4,
        block_mask_api=probe_block_mask_api(),
        deterministic=deterministic,
        device=paddle.get_device(),
        fa4_unavailable=pol.value,
        fa3_available=fa3,
        capability=cap,
        sources={
            FLAG_VERSION: req_src,
            FLAG_DETERMINISTIC: det_src,
            "capability": cap_src,
            "fa3_available": fa3_src,
            "fa4_available": fa4_src,
            "fa4_unavailable": pol.source,
            "block_mask_api": "inspect.signature(paddle.nn.functional.flashmask_attention)",
            "device": "paddle.get_device()",
        },
    )


def explain_inputs(
    inputs: DispatchInputs, head_dim: int, *, fa4_limit: str | None = None
) -> Resolution:
    """Apply the rule to probed inputs (no logging; `resolve_from_inputs` logs)."""
    return explain_fa_version(
        inputs.requested,
        fa4_available=inputs.fa4_available,
        block_mask_api=inputs.block_mask_api,
        deterministic=inputs.deterministic,
        head_dim=head_dim,
        device=inputs.device,
        fa4_unavailable=Policy(
            inputs.fa4_unavailable, inputs.sources.get("fa4_unavailable", "argument")
        ),
        fa3_available=inputs.fa3_available,
        capability=inputs.capability,
        fa4_limit=fa4_limit,
    )


def resolve_from_inputs(
    inputs: DispatchInputs, head_dim: int, *, fa4_limit: str | None = None
) -> Resolution:
    """Apply the rule to probed inputs and log the outcome once per process on rank 0."""
    res = explain_inputs(inputs, head_dim, fa4_limit=fa4_limit)
    log_once(
        f"dispatch:{res.requested}:{res.version}:{res.reason}",
        f"fa_version={res.version} (requested {res.requested}, head_dim {head_dim}): {res.reason}",
    )
    return res


def resolve_current(
    head_dim: int,
    *,
    policy: str | Policy | None = None,
    mask_shape: tuple[int, ...] | None = None,
    num_kv_heads: int | None = None,
    head_dim_v: int | None = None,
) -> Resolution:
    """Probe the environment and resolve: what an attention forward calls, once per call.

    `policy`: the trainer's `Policy` (`resolve_policy` of the config), a library caller's
    `fa4_unavailable` argument, or None (the environment's, else "error"). With
    `num_kv_heads` given, the call's shape (`mask_shape` of the mask handed to the kernel,
    `head_dim_v`) is checked against the FA4 kernel's limits (`fa4_call_limit`); a call beyond
    them treats FA4 as unavailable.
    """
    inputs = probe_inputs(policy=policy, policy_source="argument")
    limit = None
    if num_kv_heads is not None and inputs.requested == 4:
        limit = fa4_call_limit(
            mask_shape=mask_shape,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
        )
    return resolve_from_inputs(inputs, head_dim, fa4_limit=limit)
