# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark bench-acceptance`` against a stub vLLM server on 127.0.0.1.

The stub speaks the OpenAI completions protocol (plain and streamed) and serves a Prometheus page
whose speculative-decoding counters start from non-zero values and advance by a fixed amount per
request, split over two engines, next to a second model's series the client must ignore. So every
figure the client reports can be checked against arithmetic done here.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from vllm_dspark.tools import bench_acceptance as bench
from vllm_dspark.tools.cli import main

MODEL = "kimi-k3"


# Counter advance per completed request, as a K=7 DSpark server would count it: 4 verify steps
# (drafts), 28 drafted tokens, 18 accepted, by position 4, 4, 3, 3, 2, 1, 1.
PER_REQUEST = {"drafts": 4, "draft_tokens": 28, "accepted": 18, "per_pos": [4, 4, 3, 3, 2, 1, 1]}
START = {
    "drafts": 1000,
    "draft_tokens": 7000,
    "accepted": 3000,
    "per_pos": [900, 700, 500, 400, 250, 150, 100],
}
TOKENS_PER_CHUNK = 5  # a streamed chunk carries a verify step's worth of tokens, not one token


class StubState:
    def __init__(self, with_spec_counters: bool) -> None:
        self.lock = threading.Lock()
        self.with_spec_counters = with_spec_counters
        # engine -> counter values; requests alternate between the two engines
        self.engines = {
            e: {k: (list(v) if isinstance(v, list) else v) for k, v in START.items()}
            for e in ("0", "1")
        }
        self.other_model_drafts = 5.0
        self.served = 0

    def record_request(self) -> None:
        with self.lock:
            c = self.engines[str(self.served % 2)]
            self.served += 1
            for key in ("drafts", "draft_tokens", "accepted"):
                c[key] += PER_REQUEST[key]
            c["per_pos"] = [
                a + b for a, b in zip(c["per_pos"], PER_REQUEST["per_pos"], strict=True)
            ]
            self.other_model_drafts += 77  # another model's traffic, which must not leak in

    def metrics_page(self) -> str:
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0',
        ]
        if not self.with_spec_counters:
            return "\n".join(lines) + "\n"
        with self.lock:
            for name, key in (
                ("drafts", "drafts"),
                ("draft_tokens", "draft_tokens"),
                ("accepted_tokens", "accepted"),
            ):
                metric = f"vllm:spec_decode_num_{name}"
                lines += [f"# HELP {metric}_total x", f"# TYPE {metric}_total counter"]
                for engine, c in self.engines.items():
                    labels = f'engine="{engine}",model_name="{MODEL}"'
                    lines.append(f"{metric}_total{{{labels}}} {float(c[key])}")
                    lines.append(f"{metric}_created{{{labels}}} 1.7e+09")
            other = 'engine="0",model_name="other"'
            lines.append(f"vllm:spec_decode_num_drafts_total{{{other}}} {self.other_model_drafts}")
            metric = "vllm:spec_decode_num_accepted_tokens_per_pos"
            lines += [f"# HELP {metric}_total x", f"# TYPE {metric}_total counter"]
            for engine, c in self.engines.items():
                for pos, value in enumerate(c["per_pos"]):
                    lines.append(
                        f'{metric}_total{{engine="{engine}",model_name="{MODEL}",position="{pos}"}} '
                        f"{float(value)}"
                    )
        return "\n".join(lines) + "\n"


def _handler(state: StubState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            pass

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(200, state.metrics_page().encode(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                self._send(
                    200,
                    json.dumps(
                        {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
                    ).encode(),
                    "application/json",
                )
            else:
                self._send(404, b"{}", "application/json")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions" or body.get("model") != MODEL:
                self._send(404, b'{"error": "unknown model"}', "application/json")
                return
            if body["prompt"] == "FAIL":
                self._send(
                    400, b'{"error": {"message": "max_tokens is too large"}}', "application/json"
                )
                return
            n = body["max_tokens"]
            usage = {
                "prompt_tokens": len(body["prompt"].split()),
                "completion_tokens": n,
                "total_tokens": len(body["prompt"].split()) + n,
            }
            state.record_request()
            if not body.get("stream"):
                out = {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "text": " tok" * n, "finish_reason": "length"}],
                    "usage": usage,
                }
                self._send(200, json.dumps(out).encode(), "application/json")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for start in range(0, n, TOKENS_PER_CHUNK):
                chunk = {
                    "choices": [{"index": 0, "text": " tok" * min(TOKENS_PER_CHUNK, n - start)}]
                }
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if body.get("stream_options", {}).get("include_usage"):
                self.wfile.write(
                    f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                )
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


@pytest.fixture
def stub(request: pytest.FixtureRequest) -> Iterator[tuple[str, StubState]]:
    state = StubState(with_spec_counters=getattr(request, "param", True))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("one two three\nfour five\n\nsix\n")
    return path


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict[str, Any], str]:
    rc = main(["bench-acceptance", *argv])
    out, err = capsys.readouterr()
    return rc, json.loads(out), err


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_report_arithmetic_matches_the_counters(stub, prompts, capsys, stream: bool) -> None:
    url, state = stub
    n_requests, max_tokens = 10, 23
    argv = [
        "--base-url",
        url,
        "--prompts",
        str(prompts),
        "--num-prompts",
        str(n_requests),
        "--concurrency",
        "3",
        "--max-tokens",
        str(max_tokens),
        "--temperature",
        "0.7",
        "--ignore-eos",
    ]
    rc, report, table = _run(capsys, argv + (["--stream"] if stream else []))

    assert rc == 0 and state.served == n_requests
    assert report["model"] == MODEL and report["requests"] == {
        "completed": n_requests,
        "failed": 0,
        "errors": [],
    }
    acc = report["acceptance"]
    assert acc["num_drafts"] == 4 * n_requests
    assert acc["num_draft_tokens"] == 28 * n_requests
    assert acc["num_accepted_tokens"] == 18 * n_requests
    assert acc["mean_acceptance_length"] == pytest.approx(1 + 18 / 4)  # 5.5: the bonus token counts
    assert acc["draft_acceptance_rate"] == pytest.approx(18 / 28)
    assert acc["per_position_acceptance_rate"] == pytest.approx(
        [1.0, 1.0, 0.75, 0.75, 0.5, 0.25, 0.25]
    )

    # Tokens come from usage: 23 per request, although a stream sends only ceil(23 / 5) = 5 text chunks.
    assert report["output_tokens"] == n_requests * max_tokens
    assert report["prompt_tokens"] == sum(
        len(p.split()) for p in (["one two three", "four five", "six"] * 4)[:10]
    )
    assert report["output_tokens_per_s"] == pytest.approx(
        report["output_tokens"] / report["wall_s"]
    )
    lat = report["latency_s"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"] <= report["wall_s"]
    assert (report["ttft_s"] is not None) == stream
    if stream:
        assert 0 < report["ttft_s"]["p50"] <= lat["p99"]
    assert re.search(r"\| mean acceptance length +\| 5\.500 \|", table)
    assert re.search(r"\| acceptance at position 6 +\| 0\.250 \|", table)


def test_failed_requests_are_counted_and_explained(stub, tmp_path, capsys) -> None:
    url, _ = stub
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "fine prompt"}) + "\n" + json.dumps({"prompt": "FAIL"}) + "\n"
    )
    rc, report, _ = _run(
        capsys, ["--base-url", url, "--prompts", str(path), "--max-tokens", "8", "--model", MODEL]
    )
    assert rc == 0
    assert report["requests"]["completed"] == 1 and report["requests"]["failed"] == 1
    assert report["requests"]["errors"] == [
        'HTTP 400: {"error": {"message": "max_tokens is too large"}}'
    ]
    assert report["output_tokens"] == 8
    assert report["acceptance"]["mean_acceptance_length"] == pytest.approx(5.5)


@pytest.mark.parametrize("stub", [False], indirect=True)
def test_a_server_without_spec_decode_counters_is_refused(stub, prompts, capsys) -> None:
    url, state = stub
    assert main(["bench-acceptance", "--base-url", url, "--prompts", str(prompts)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("vllm-dspark bench-acceptance: error: ")
    assert "has no vllm:spec_decode_num_drafts counter" in line
    assert state.served == 0  # refused before sending traffic


def test_no_server_and_no_prompts_are_one_line_errors(stub, prompts, tmp_path, capsys) -> None:
    url, _ = stub
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    for argv, says in (
        (["--base-url", closed, "--prompts", str(prompts)], f"cannot reach {closed}/v1/models"),
        (["--base-url", url, "--metrics-path", "/nowhere", "--prompts", str(prompts)], "HTTP 404"),
        (["--base-url", url, "--prompts", str(empty)], "holds no prompts"),
        (["--base-url", url, "--prompts", str(tmp_path / "missing.txt")], "missing.txt"),
    ):
        assert main(["bench-acceptance", *argv]) == 2, argv
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith("vllm-dspark bench-acceptance: error: ") and says in line, line


def test_percentile_matches_linear_interpolation() -> None:
    values = [float(v) for v in range(10, 0, -1)]  # unsorted on purpose
    assert bench.percentile(values, 50) == pytest.approx(5.5)
    assert bench.percentile(values, 90) == pytest.approx(9.1)
    assert bench.percentile(values, 99) == pytest.approx(9.91)
    assert bench.percentile([3.0], 99) == 3.0
    assert bench.percentile([], 50) is None


def test_counter_parser_reads_bare_names_and_escaped_labels() -> None:
    page = (
        'vllm:spec_decode_num_drafts{model_name="a \\"quoted\\" name"} 3\n'
        'vllm:spec_decode_num_accepted_tokens{model_name="a \\"quoted\\" name"} 6 1712345678\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos{model_name="a \\"quoted\\" name",position="1"} 2\n'
        'vllm:spec_decode_num_drafts{model_name="b"} 100\n'
    )
    c = bench.parse_spec_counters(page, 'a "quoted" name')
    assert (c.drafts, c.accepted, c.accepted_per_pos) == (3.0, 6.0, {1: 2.0})
    assert bench.parse_spec_counters(page).drafts == 103.0
    assert bench.parse_spec_counters("# nothing\n") is None
