"""flashcp: context-parallel FlashMask attention training on PaddlePaddle."""

import warnings

# Paddle warns about a missing ccache on every import (it only matters for building custom C++
# ops, which flashcp does not do); keep users' consoles readable.
warnings.filterwarnings("ignore", message="No ccache found")

__version__ = "0.1.0"
