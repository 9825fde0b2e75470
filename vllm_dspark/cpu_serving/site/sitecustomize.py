# SPDX-License-Identifier: Apache-2.0
"""Run at Python's start where this folder is on ``PYTHONPATH``: the interpreter runtime, before vLLM loads."""

from vllm_dspark.cpu_serving import enable

enable()
