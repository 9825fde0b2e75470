# SPDX-License-Identifier: Apache-2.0
#
# The part of the Kimi-K3 + DSpark serve recipes that does not depend on the hardware. Sourced by
# serve_gb300_multinode.sh and serve_h200.sh after they set NNODES, GPUS_PER_NODE, NODE_RANK and
# DRAFT_ATTENTION_BACKEND; see either script for the settings it reads from the environment.
# `vllm-dspark serve-cpu --print-recipe NAME` prints a recipe with this file inlined, below the
# `# shellcheck shell=bash` line.
# shellcheck shell=bash
: "${NNODES:?} ${GPUS_PER_NODE:?} ${NODE_RANK:?} ${DRAFT_ATTENTION_BACKEND:?}"

MODEL=${MODEL:-moonshotai/Kimi-K3}
DRAFTER=${DRAFTER:-Inferact/Kimi-K3-DSpark}
MASTER_PORT=${MASTER_PORT:-29501}
PORT=${PORT:-8000}
KV_CACHE_DTYPE=${KV_CACHE_DTYPE:-auto}
SERVED_MODEL_NAME=${SERVED_MODEL_NAME:-kimi-k3}
SAMPLING=${SAMPLING:-probabilistic}
ADAPTIVE=${ADAPTIVE:-0}
NUM_SPECULATIVE_TOKENS=7  # the drafter's block_size: fewer gives garbage drafts, more wastes verification

case "$SAMPLING" in
  probabilistic) sampling_json='"draft_sample_method": "probabilistic", "rejection_sample_method": "block"' ;;
  greedy) sampling_json='"draft_sample_method": "greedy"' ;;
  *) echo "SAMPLING must be probabilistic or greedy, got '$SAMPLING'" >&2; exit 2 ;;
esac
adaptive_json=""
compilation_args=()
if [[ "$ADAPTIVE" == 1 ]]; then
  adaptive_json=', "enable_adaptive_verification": true'
  # Adaptive verification varies per-request query lengths on the device: it needs full CUDA graphs.
  compilation_args=(--compilation-config '{"cudagraph_mode": "FULL_AND_PIECEWISE"}')
fi
speculative_config=$(printf '{"method": "dspark", "model": "%s", "num_speculative_tokens": %d, "attention_backend": "%s", %s%s}' \
  "$DRAFTER" "$NUM_SPECULATIVE_TOKENS" "$DRAFT_ATTENTION_BACKEND" "$sampling_json" "$adaptive_json")

run() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%s\0' "$@"
    printf '\n'
  else
    "$@"
  fi
}

serve_args=(
  "$MODEL"
  --tensor-parallel-size $((NNODES * GPUS_PER_NODE))
  --kv-cache-dtype "$KV_CACHE_DTYPE"
  --speculative-config "$speculative_config"
  "${compilation_args[@]}"
  --trust-remote-code
)
if [[ "$NNODES" -gt 1 ]]; then
  : "${MASTER_ADDR:?set MASTER_ADDR to the IP address of the head node}"
  serve_args+=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
if [[ "$NODE_RANK" == 0 ]]; then
  serve_args+=(--served-model-name "$SERVED_MODEL_NAME" --host 0.0.0.0 --port "$PORT")
  if [[ "${SKIP_DOCTOR:-0}" != 1 ]]; then
    # Check the speculative config against the drafter and this GPU before 1 T parameters load.
    # It reads local files only: fetch the drafter, and the target's config.json, first.
    if [[ ! -d "$DRAFTER" ]]; then
      run hf download "$DRAFTER"
    fi
    if [[ ! -d "$MODEL" ]]; then
      run hf download "$MODEL" config.json
    fi
    run vllm-dspark doctor --speculative-config "$speculative_config" --target "$MODEL" \
      --kv-cache-dtype "$KV_CACHE_DTYPE" "${compilation_args[@]}"
  fi
else
  serve_args+=(--headless)
fi

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  run vllm serve "${serve_args[@]}"
else
  exec vllm serve "${serve_args[@]}"
fi
