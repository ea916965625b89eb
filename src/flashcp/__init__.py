"""flashcp: context-parallel FlashMask attention training on PaddlePaddle."""

__version__ = "0.1.0"
