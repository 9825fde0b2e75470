# SPDX-License-Identifier: Apache-2.0
"""Python runs this at startup when this directory is on ``PYTHONPATH``: it enables
``tests/triton_interpreter.py`` before anything imports vLLM, in the server and in every process vLLM
spawns (its CPU platform starts the engine core with ``spawn``). Test and example use only."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_interpreter  # noqa: E402

triton_interpreter.enable()
