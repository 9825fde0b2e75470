#!/usr/bin/env bash
# Printed by `vllm-dspark serve-cpu --print-recipe gb300-multinode` from vllm_dspark/data/serve_gb300_multinode.sh
# with _serve_common.sh inlined.
# SPDX-License-Identifier: Apache-2.0
#
# Serve Kimi-K3 with the DSpark drafter on 4 nodes x 4 GB300 (tensor-parallel 16) with vLLM's
# multiprocessing multi-node launch: every node runs this script with its own NODE_RANK; node 0
# serves the OpenAI API, nodes 1-3 run headless workers. (vLLM's Ray path works as well; see
# docs/serving.md.) tests/serving/test_multinode.py runs this launch (NNODES=2, TP 2) on one CPU
# machine, two "nodes" on 127.0.0.1 (docs/compatibility.md#several-processes-on-cpu-tp-4-and-the-two-node-launch).
#
#   node 0:     NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash serve_gb300_multinode.sh
#   nodes 1-3:  NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash serve_gb300_multinode.sh    (2, 3 likewise)
#
# Settings (environment):
#   SAMPLING=probabilistic  for clients that sample (temperature > 0): probabilistic drafting and
#                           block verification (default)
#   SAMPLING=greedy         for temperature-0 clients: greedy drafting, standard verification
#   ADAPTIVE=1              confidence-scheduled (adaptive) verification; pays at high concurrency
#   MODEL, DRAFTER, NNODES, MASTER_PORT, PORT, KV_CACHE_DTYPE, SERVED_MODEL_NAME
#   SKIP_DOCTOR=1           do not run `vllm-dspark doctor` on node 0 before launching
#   DRY_RUN=1               print each command (arguments NUL-separated, one command per line)
#                           instead of running it
set -euo pipefail

NNODES=${NNODES:-4}
GPUS_PER_NODE=4
NODE_RANK=${NODE_RANK:?"set NODE_RANK to this node index: 0 on the head node, 1 to $((NNODES - 1)) on the others"}
: "${MASTER_ADDR:?set MASTER_ADDR to the IP address of the head node}"
# Blackwell (compute capability 10.x): FlashInfer's MLA kernels run the drafter's non-causal block.
DRAFT_ATTENTION_BACKEND=FLASHINFER_MLA

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
