# SPDX-License-Identifier: Apache-2.0
"""The one way the tools draw PNGs: matplotlib's headless backend, or a warning and no plots without it."""

from __future__ import annotations

import warnings
from types import ModuleType


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the Agg backend; ``None`` (with one warning) if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        warnings.warn(
            "matplotlib is not installed (pip install 'vllm_dspark[plots]'); skipping the PNG plots."
        )
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
