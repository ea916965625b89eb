"""AdamW and global-norm gradient clipping, both Paddle's own (`paddle.optimizer.AdamW`,
`paddle.nn.ClipGradByGlobalNorm`); the LR schedule is `flashcp.optim.lr`.

Clipping runs inside `optimizer.step()`, after the trainer has summed gradients over the cp and
dp ranks, so the norm it clips is the global one (every rank holds the same summed gradients).
Weight decay applies to matrices and embeddings, not to biases and norm scales (1-D tensors).
"""

from __future__ import annotations

from typing import Any

import paddle

from flashcp.config.schema import TrainConfig


def decay_parameter_names(model: paddle.nn.Layer) -> set[str]:
    """Paddle names (`param.name`) of the parameters that get weight decay (ndim >= 2)."""
    return {p.name for p in model.parameters() if len(p.shape) >= 2}


def build_optimizer(
    model: paddle.nn.Layer, train: TrainConfig, scheduler: Any, *, clip: Any = None
) -> paddle.optimizer.AdamW:
    """AdamW over `model`'s trainable parameters, clipping by global norm when grad_clip > 0.

    `clip` replaces Paddle's `ClipGradByGlobalNorm(train.grad_clip)` (pipeline stages pass
    `flashcp.optim.clip.PipelineGlobalNormClip`, which clips by the whole model's norm).
    """
    decay = decay_parameter_names(model)
    params = [p for p in model.parameters() if not p.stop_gradient]
    if clip is None and train.grad_clip > 0:
        clip = paddle.nn.ClipGradByGlobalNorm(train.grad_clip)
    return paddle.optimizer.AdamW(
        learning_rate=scheduler,
        parameters=params,
        beta1=train.beta1,
        beta2=train.beta2,
        epsilon=train.eps,
        weight_decay=train.weight_decay,
        apply_decay_param_fun=lambda name: name in decay,
        grad_clip=clip,
    )
