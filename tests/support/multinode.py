# SPDX-License-Identifier: Apache-2.0
"""The GB300 recipe's multi-node launch, shrunk onto one CPU machine: two ``vllm serve`` processes
on 127.0.0.1 as two "nodes" (rank 0 serving the API, rank 1 ``--headless``), TP 2 across them.

The commands are the recipe's own (``serve_gb300_multinode.sh`` with ``DRY_RUN=1``, ``NNODES=2``)
with what a CPU cannot take swapped out (:func:`recipe_commands`). Every process gets
:mod:`vllm_dspark.cpu_serving`'s ``site/`` on ``PYTHONPATH`` (Model Runner V2 under Triton's
interpreter), and the plugin only through its ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "vllm_dspark" / "data" / "serve_gb300_multinode.sh"
VLLM = Path(sys.executable).with_name("vllm")
# What the plugin's register() logs, once in each process that loads vLLM's general plugins.
REGISTERED = "overrides vLLM's in-tree K3 DSpark drafter"
# On CPU: a small context (the interpreted kernels loop over token budgets), eager, the KV cache capped.
CPU_ARGS = ("--max-model-len", "128", "--max-num-batched-tokens", "128", "--enforce-eager")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_argv(
    node_rank: int, model: Path, drafter: Path, master_port: int, port: int
) -> list[str]:
    """The command the GB300 recipe runs on node ``node_rank`` of two (``DRY_RUN=1``, greedy drafting)."""
    env = {
        **os.environ,
        "NODE_RANK": str(node_rank),
        "NNODES": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "PORT": str(port),
        "MODEL": str(model),
        "DRAFTER": str(drafter),
        "SAMPLING": "greedy",
        "SKIP_DOCTOR": "1",
        "DRY_RUN": "1",
    }
    out = subprocess.run(
        ["bash", str(RECIPE)], env=env, capture_output=True, text=True, check=True
    ).stdout
    [line] = out.splitlines()
    return line.split("\0")[:-1]


def recipe_commands(
    model: Path,
    drafter: Path | None,
    master_port: int,
    port: int,
) -> list[list[str]]:
    """Both nodes' commands: the recipe's, with TP 2 (one worker per "node") instead of 4 GB300s per
    node, no draft attention backend (FLASHINFER_MLA; vLLM's CPU platform picks its MLA backend), the
    API on 127.0.0.1, and :data:`CPU_ARGS`; without ``drafter``, no speculative config (the baseline)."""
    commands = []
    for rank in (0, 1):
        argv = recipe_argv(rank, model, drafter or model, master_port, port)
        assert argv[:2] == ["vllm", "serve"], argv
        argv[argv.index("--tensor-parallel-size") + 1] = "2"
        spec = argv.index("--speculative-config")
        if drafter is None:
            del argv[spec : spec + 2]
        else:
            config = json.loads(argv[spec + 1])
            del config["attention_backend"]
            argv[spec + 1] = json.dumps(config)
        if "--host" in argv:
            argv[argv.index("--host") + 1] = "127.0.0.1"
        commands.append([str(VLLM), *argv[1:], *CPU_ARGS])
    return commands


def environ(metadata: Path | None) -> dict[str, str]:
    """Each process's environment: ``site/`` first on ``PYTHONPATH``, the KV cache capped, and where
    ``metadata`` is given, that folder too (a ``vllm`` distribution's metadata: see ``vllm_metadata``)."""
    from vllm_dspark.cpu_serving import environ as cpu_environ

    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if metadata is not None:
        base["PYTHONPATH"] = str(metadata)
    env = cpu_environ(base)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the server as users run it
    return env


def vllm_metadata(folder: Path) -> Path:
    """A folder holding the ``vllm`` distribution metadata vllm-cpu lacks (it installs as ``vllm-cpu``),
    which the ``vllm`` command's ``--version`` option looks up: at the version vLLM's platform
    detection reads for vllm-cpu (``X+cpu``; without ``cpu`` in it vLLM does not pick its CPU platform)."""
    from importlib.metadata import version

    cpu_version = version("vllm-cpu") + "+cpu"
    info = folder / f"vllm-{cpu_version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu_version}\n")
    return folder


def get(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def post(url: str, body: dict, timeout: float = 1800) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@contextmanager
def two_nodes(
    commands: Sequence[Sequence[str]], env: dict[str, str], logs: Path, port: int
) -> Iterator[str]:
    """Start rank 1 (headless) then rank 0, each in its own process group logging to
    ``logs/node{rank}.log``; yield rank 0's API address once it answers ``/health``; stop both."""
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        procs = []
        for rank in (1, 0):
            log = stack.enter_context(open(logs / f"node{rank}.log", "w"))
            proc = subprocess.Popen(
                commands[rank],
                cwd=logs,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            stack.callback(_stop, proc)
            procs.append((rank, proc))
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 1200
        while True:
            for rank, proc in procs:
                assert proc.poll() is None, (
                    f"node {rank} exited ({proc.returncode}):\n{tail(logs / f'node{rank}.log')}"
                )
            assert time.monotonic() < deadline, f"no server:\n{tail(logs / 'node0.log')}"
            try:
                get(f"{base_url}/health", timeout=10)
                break
            except OSError:
                time.sleep(3)
        yield base_url


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group the node started (its engine core and workers), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:]


def registered_in(log: Path) -> set[str]:
    """The processes (vLLM's ``(Name pid=N)`` prefix) whose log holds register()'s line."""
    found = set()
    for line in log.read_text(errors="replace").splitlines():
        if REGISTERED in line and line.startswith("("):
            found.add(line[1 : line.index(")")])
    return found
