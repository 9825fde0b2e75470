# SPDX-License-Identifier: Apache-2.0
"""vLLM's ``dspark`` speculator served on CPU, under Triton's interpreter (opt-in, never imported by ``register()``).

vLLM's CPU platform starts its engine core and workers with ``spawn``, so every process of a server
must enable the interpreter before it imports vLLM: :func:`environ` puts ``site/`` on ``PYTHONPATH``,
whose ``sitecustomize`` does that at each interpreter's start. An in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) calls :func:`enable` first instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from vllm_dspark.cpu_serving import interpreter, kimi_k3

SITE = Path(__file__).resolve().parent / "site"


def enable() -> None:
    """Triton's interpreter and Model Runner V2 (:mod:`.interpreter`), and vLLM's Kimi-K3 target on CPU (:mod:`.kimi_k3`); idempotent."""
    interpreter.enable()
    kimi_k3.enable()


def environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) with :data:`SITE` first on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p)
    return env
