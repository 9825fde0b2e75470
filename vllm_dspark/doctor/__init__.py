# SPDX-License-Identifier: Apache-2.0
"""The doctor: pure checks of a DSpark ``--speculative-config`` (``checks``), what they read (``facts``) and
the serve-time hook (``serve``); the command is :mod:`vllm_dspark.tools.doctor`."""
