#!/usr/bin/env bash
# Printed by `vllm-dspark serve-cpu --print-recipe h200` from vllm_dspark/data/serve_h200.sh
# with _serve_common.sh inlined.
# SPDX-License-Identifier: Apache-2.0
#
# Serve Kimi-K3 with the DSpark drafter on Hopper (8 x H200 per node). The recipe is the GB300 one
# (serve_gb300_multinode.sh) with one change: FlashInfer's MLA kernels run only on compute
# capability 10.x, so the draft uses TRITON_MLA, which runs the drafter's non-causal block on 9.x.
#
#   one node:   bash serve_h200.sh                                         (tensor-parallel 8)
#   two nodes:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash serve_h200.sh   on the head node,
#               NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash serve_h200.sh   on the other (TP 16)
#
# Whether the target fits one node depends on the precision of the Kimi-K3 checkpoint you serve;
# if vLLM reports too little KV-cache memory on one node, use two.
#
# Settings (environment):
#   SAMPLING=probabilistic  for clients that sample (temperature > 0): probabilistic drafting and
#                           block verification (default)
#   SAMPLING=greedy         for temperature-0 clients: greedy drafting, standard verification
#   ADAPTIVE=1              confidence-scheduled (adaptive) verification; pays at high concurrency
#   MODEL, DRAFTER, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, PORT, KV_CACHE_DTYPE, SERVED_MODEL_NAME
#   SKIP_DOCTOR=1           do not run `vllm-dspark doctor` before launching
#   DRY_RUN=1               print each command (arguments NUL-separated, one command per line)
#                           instead of running it
set -euo pipefail

NNODES=${NNODES:-1}
GPUS_PER_NODE=8
NODE_RANK=${NODE_RANK:-0}
# Hopper (compute capability 9.x): FLASHINFER_MLA needs 10.x; TRITON_MLA runs the non-causal block.
DRAFT_ATTENTION_BACKEND=TRITON_MLA

# The part every GPU recipe shares (_serve_common.sh):
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
