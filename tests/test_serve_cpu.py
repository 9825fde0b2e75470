# SPDX-License-Identifier: Apache-2.0
"""examples/serve_cpu.sh starts vLLM's real OpenAI server on 127.0.0.1 with the dspark drafter, and
examples/bench_acceptance.py reports exactly what the server's own ``/metrics`` counted.

The models are ``tests/dspark_e2e.py``'s (a tiny MLA target with a word-level tokenizer and a
drafter made ``--like`` it). The server runs Model Runner V2 under Triton's interpreter, like the
end-to-end tests, so the client's load is small.
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

from tests.test_bench_acceptance import bench

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 6
PROMPTS = ["w11 w250 w3000 w42 w7 w900 w12", "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


@pytest.fixture(scope="module")
def server(
    dspark_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU recipe needs the CPU build of vLLM")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve_cpu") / "server.log"
    env = {
        **os.environ,
        "MODEL": str(dspark_models["target"]),
        "DRAFTER": str(dspark_models["drafter"]),
        "PORT": str(port),
        "MAX_MODEL_LEN": "128",
        "PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["bash", str(ROOT / "examples" / "serve_cpu.sh")],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
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
