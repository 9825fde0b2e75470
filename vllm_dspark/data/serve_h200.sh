#!/usr/bin/env bash
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

# shellcheck source-path=SCRIPTDIR source=_serve_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_serve_common.sh"
