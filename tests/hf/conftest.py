"""The hf tier imports torch before anything imports PaddleFormers: PaddleFormers, imported
first, hides torch from transformers (it sets `sys.modules["torch"] = None` when torch is not
loaded yet), so a test that reaches PaddleFormers before its first torch import (e.g. one
export test run alone) would find transformers without torch. Without torch on the path (the
default run, which deselects this tier) nothing happens."""

import contextlib

with contextlib.suppress(ImportError):
    import torch  # noqa: F401
