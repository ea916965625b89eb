"""flashcp: context-parallel FlashMask attention training on PaddlePaddle.

The public API (`docs/api.md`): each name lives in its documented module and is importable
from here, loaded on first use (PEP 562), so `import flashcp` (and `flashcp.config`, the
launcher's config layer) imports no Paddle:

    import flashcp
    cfg = flashcp.load_config("configs/gpt/tiny_cp2.yaml", ["train.steps=3"])
    mask = flashcp.causal_document_mask([[100, 156]])
    out = flashcp.flashmask_attention(q, k, v, mask.indices, causal=mask.causal)

Modules that moved keep their old import path for one release, with a `DeprecationWarning`
naming the new one (`MOVED_MODULES`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

# Paddle warns about a missing ccache on every import (it only matters for building custom C++
# ops, which flashcp does not do); keep users' consoles readable.
warnings.filterwarnings("ignore", message="No ccache found")

__version__ = "0.1.0"

_MASK_NAMES = (
    "Mask",
    "DocumentMasking",
    "causal_mask",
    "sliding_window_mask",
    "causal_document_mask",
    "sliding_window_document_mask",
    "document_mask",
    "share_question_mask",
    "prefix_lm_causal_mask",
    "prefix_lm_document_mask",
    "global_sliding_window_mask",
    "causal_blockwise_mask",
    "random_eviction_mask",
    "qk_sparse_mask",
)

PUBLIC: dict[str, str] = {
    "flashmask_attention": "flashcp.attention.flashmask",
    "flashmask_attention_cp": "flashcp.attention.allgather_kv",
    "AttentionContext": "flashcp.attention.context",
    **dict.fromkeys(_MASK_NAMES, "flashcp.masks"),
    "build_model": "flashcp.models",
    "from_pretrained": "flashcp.pretrained",
    "load_config": "flashcp.config",
    "Trainer": "flashcp.trainer",
}
"""Each public name → the module that defines it (its documented place)."""

MOVED_MODULES: dict[str, str] = {
    "flashcp.cp.attention": "flashcp.attention.allgather_kv",
}
"""Module paths of the previous release → where their contents live now (issue 19's move):
importing the old path gives the new module's names and a `DeprecationWarning`. (The previous
`flashcp.attention` module is the package's lazy exports now, and `flashcp.models`'
`AttentionContext` a deprecated name of `flashcp.models`.)"""

__all__ = ["__version__", *PUBLIC]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module the first time it is asked for."""
    module = PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'flashcp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *PUBLIC})


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves each old path of `MOVED_MODULES` as a module holding the new module's names."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> None:
        return None  # the default: a fresh module, filled by exec_module

    def exec_module(self, module: ModuleType) -> None:
        new = MOVED_MODULES[module.__name__]
        warnings.warn(
            f"{module.__name__} moved to {new} (flashcp {__version__}): import from {new} or "
            "from flashcp (docs/api.md); the old path goes away in the next release",
            DeprecationWarning,
            stacklevel=2,  # the importing line (the import system's frames are skipped)
        )
        target = importlib.import_module(new)
        module.__dict__.update(
            {k: v for k, v in vars(target).items() if not k.startswith("__")}
        )
        module.__doc__ = f"Deprecated alias of `{new}`."


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
