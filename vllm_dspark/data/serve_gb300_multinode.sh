#!/usr/bin/env bash
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

# shellcheck source-path=SCRIPTDIR source=_serve_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_serve_common.sh"
