# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark doctor``: check a DSpark ``--speculative-config`` before a 1 T-param target loads.

Several K3 DSpark mistakes pass vLLM's field-by-field validation and surface only after the target
has loaded (a KV-cache dtype the shared MLA group rejects, a draft attention backend the GPU cannot
run), or never (too few speculative tokens: garbage drafts, silently low acceptance). ``checks``
holds the pure checks, ``facts`` gathers their inputs from vLLM, this machine and the files,
``serve`` runs them inside vLLM before the target loads (installed by ``register()``) and ``cli``
is the command.
"""
