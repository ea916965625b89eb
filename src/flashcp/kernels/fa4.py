"""FA4 backend: the CuTe-DSL FlashMask kernels of `paddlefleet_ops` (SM100 only).

Imported lazily through `flashcp.fa_dispatch.import_cute_fa4()`, so this module loads anywhere.
Calls (reference §1.6):

* forward `_flash_attn_fwd(q, k, v, causal=..., return_lse=True, startend_row_indices=...,
  softmax_scale=..., pack_gqa=False)` -> `(out, lse, ...)`;
* backward `_flash_attn_bwd(q, k, v, out, dout, lse, flashmask_info, softmax_scale=...,
  causal=..., deterministic=...)`, where `flashmask_info` is
  `FlashMaskInfoPaddle(startend_row_indices=..., is_causal=causal)` (None without a mask) and
  is passed **positionally** as the 7th argument (that slot was renamed upstream; everything
  else goes by keyword). Newer builds return `(dq, dk, dv, dsink)`; the first three are used.

Every call runs with `FLAGS_flash_attn_version` held at 4 (`flash_attn_version_flag`), like
the FA2/FA3 backends hold it at their own version.

`deterministic` defaults to `FLAGS_cudnn_deterministic` read at backward time: it selects
FA4's deterministic backward and never changes which kernel family runs.
"""

from __future__ import annotations

from typing import Any

from flashcp.kernels.base import flash_attn_version_flag, resolve_scale


def _cute() -> tuple[Any, Any, Any]:
    from flashcp.fa_dispatch import import_cute_fa4

    return import_cute_fa4()


def _deterministic() -> bool:
    from flashcp.fa_dispatch import probe_deterministic

    return probe_deterministic()[0]


class FA4Backend:
    """CuTe FlashMask (FA4) forward and backward."""

    name = "fa4"
    version = 4

    def forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        startend_row_indices: Any,
        *,
        causal: bool,
        softmax_scale: float | None,
    ) -> tuple[Any, Any]:
        fwd, _bwd, _info = _cute()
        with flash_attn_version_flag(self.version):
            result = fwd(
                q,
                k,
                v,
                causal=causal,
                return_lse=True,
                startend_row_indices=startend_row_indices,
                softmax_scale=resolve_scale(softmax_scale, int(q.shape[-1])),
                pack_gqa=False,
            )
        return result[0], result[1]

    def backward(
        self,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        startend_row_indices: Any,
        dout: Any,
        *,
        causal: bool,
        softmax_scale: float | None,
        deterministic: bool | None = None,
    ) -> tuple[Any, Any, Any]:
        _fwd, bwd, info_cls = _cute()
        info = (
            None
            if startend_row_indices is None
            else info_cls(startend_row_indices=startend_row_indices, is_causal=causal)
        )
        det = _deterministic() if deterministic is None else bool(deterministic)
        with flash_attn_version_flag(self.version):
            result = bwd(
                q,
                k,
                v,
                out,
                dout,
                lse,
                info,
                softmax_scale=resolve_scale(softmax_scale, int(q.shape[-1])),
                causal=causal,
                deterministic=det,
            )
        return result[0], result[1], result[2]
