# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark bench-acceptance``: speculative-decoding acceptance on your own prompts, measured
against a running vLLM server.

Drives an OpenAI-compatible server's completions API with a prompt set at a fixed concurrency,
reads vLLM's speculative-decoding Prometheus counters before and after, and reports:

* mean acceptance length = 1 + accepted / drafts (the bonus token included, as vLLM logs it);
* per-position acceptance rates = accepted at position i / drafts;
* output tokens/s, from each response's ``usage`` field: a streamed chunk carries one verify
  step's worth of tokens, so counting chunks under-counts by about the acceptance length;
* per-request latency percentiles (and time to first token with ``--stream``).

The counters are server-wide: run this with no other traffic on the server, or the deltas include
it. It imports neither vLLM nor torch, so it runs as well from a machine other than the server's.
JSON goes to stdout, a table to stderr:

    vllm-dspark bench-acceptance --base-url http://HEAD:8000 --prompts prompts.txt \\
        --concurrency 8 --temperature 1.0 --max-tokens 512 > acceptance.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_dspark.tools.cli import ArgumentParser, add_shared

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
PERCENTILES = (50, 90, 95, 99)

# One Prometheus text-format sample: name, optional {labels}, value (an optional timestamp follows).
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters, summed over engines (data-parallel ranks)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        positions = set(self.accepted_per_pos) | set(other.accepted_per_pos)
        return SpecCounters(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted - other.accepted,
            {
                p: self.accepted_per_pos.get(p, 0.0) - other.accepted_per_pos.get(p, 0.0)
                for p in sorted(positions)
            },
        )


def _unescape(value: str) -> str:
    """Undo the text format's label escapes: \\\\, \\" and \\n."""
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_spec_counters(text: str, model: str | None = None) -> SpecCounters | None:
    """The spec-decode counters in a Prometheus text page; None if the page has none.

    Counters appear as ``<name>_total`` (prometheus_client) or bare ``<name>``; ``_created``
    samples are skipped. With ``model``, samples whose ``model_name`` label names another model
    are skipped.
    """
    out = SpecCounters()
    found = False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels_text, value = m.groups()
        name = name.removesuffix("_total")
        if name not in (DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POS):
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(labels_text or "")}
        if model is not None and labels.get("model_name", model) != model:
            continue
        found = True
        v = float(value)
        if name == DRAFTS:
            out.drafts += v
        elif name == DRAFT_TOKENS:
            out.draft_tokens += v
        elif name == ACCEPTED:
            out.accepted += v
        else:
            pos = int(labels["position"])
            out.accepted_per_pos[pos] = out.accepted_per_pos.get(pos, 0.0) + v
    return out if found else None


def acceptance_summary(delta: SpecCounters) -> dict[str, Any]:
    """Acceptance metrics from counter deltas (None where there were no drafts)."""
    drafts = delta.drafts
    return {
        "num_drafts": drafts,
        "num_draft_tokens": delta.draft_tokens,
        "num_accepted_tokens": delta.accepted,
        "mean_acceptance_length": 1.0 + delta.accepted / drafts if drafts else None,
        "draft_acceptance_rate": delta.accepted / delta.draft_tokens
        if delta.draft_tokens
        else None,
        "per_position_acceptance_rate": [
            delta.accepted_per_pos[p] / drafts for p in sorted(delta.accepted_per_pos)
        ]
        if drafts
        else [],
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    rank = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


@dataclass
class RequestResult:
    ok: bool
    latency_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    error: str | None = None


class Client:
    """Minimal OpenAI-compatible HTTP client (urllib; one connection per request)."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _open(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, headers=self.headers)
        return urllib.request.urlopen(req, timeout=self.timeout)

    def get_text(self, path: str) -> str:
        """The body of ``GET path``; a server that is not there or not vLLM is a one-line error."""
        url = self.base_url + path
        try:
            with self._open(path) as resp:
                return resp.read().decode()
        except urllib.error.HTTPError as e:
            raise ValueError(f"{url}: HTTP {e.code}; is --base-url a vLLM server's root?") from e
        except urllib.error.URLError as e:
            raise ValueError(
                f"cannot reach {url} ({e.reason}); start the server or fix --base-url"
            ) from e

    def first_model(self) -> str:
        return json.loads(self.get_text("/v1/models"))["data"][0]["id"]

    def complete(self, payload: Mapping[str, Any]) -> RequestResult:
        t0 = time.perf_counter()
        try:
            if payload.get("stream"):
                return self._complete_stream(payload, t0)
            with self._open("/v1/completions", payload) as resp:
                usage = json.loads(resp.read())["usage"]
            return RequestResult(
                True, time.perf_counter() - t0, usage["prompt_tokens"], usage["completion_tokens"]
            )
        except urllib.error.HTTPError as e:  # the body says why (e.g. max_tokens over the context)
            return RequestResult(
                False, time.perf_counter() - t0, error=f"HTTP {e.code}: {e.read()[:300].decode()}"
            )
        except (OSError, KeyError, ValueError) as e:  # URLError and timeouts are OSErrors
            return RequestResult(False, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")

    def _complete_stream(self, payload: Mapping[str, Any], t0: float) -> RequestResult:
        ttft, usage = None, None
        with self._open("/v1/completions", payload) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:") :])
                if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - t0
                usage = chunk.get("usage") or usage
        latency = time.perf_counter() - t0
        if usage is None:
            return RequestResult(
                False, latency, ttft_s=ttft, error="the stream carried no usage chunk"
            )
        return RequestResult(
            True, latency, usage["prompt_tokens"], usage["completion_tokens"], ttft
        )


def load_prompts(path: Path, num_prompts: int | None) -> list[str]:
    """Prompts from a text file (one per line) or JSONL (``{"prompt": ...}`` per line).

    With ``num_prompts``, the list is cycled or cut to that length.
    """
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        prompts.append(json.loads(line)["prompt"] if path.suffix == ".jsonl" else line)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    if num_prompts is not None:
        prompts = [prompts[i % len(prompts)] for i in range(num_prompts)]
    return prompts


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    prompts = load_prompts(Path(args.prompts), args.num_prompts)
    client = Client(args.base_url, args.api_key, args.timeout)
    model = args.model or client.first_model()
    metrics_path = args.metrics_path

    before = parse_spec_counters(client.get_text(metrics_path), model)
    if before is None:
        raise ValueError(
            f"{args.base_url}{metrics_path} has no {DRAFTS} counter: is the server running with "
            "--speculative-config, and without --disable-log-stats?"
        )
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    if args.top_p is not None:
        payload["top_p"] = args.top_p
    if args.ignore_eos:
        payload["ignore_eos"] = True  # a vLLM extension: every request generates max_tokens
    if args.stream:
        payload |= {"stream": True, "stream_options": {"include_usage": True}}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        results = list(pool.map(lambda p: client.complete({**payload, "prompt": p}), prompts))
    wall = time.perf_counter() - t0
    after = parse_spec_counters(client.get_text(metrics_path), model)
    assert after is not None  # the counters existed a moment ago

    return summarize(
        results,
        wall,
        after - before,
        model=model,
        settings={
            "base_url": args.base_url,
            "prompts": args.prompts,
            "num_prompts": len(prompts),
            "concurrency": args.concurrency,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos,
            "stream": args.stream,
        },
    )


def summarize(
    results: Sequence[RequestResult],
    wall_s: float,
    delta: SpecCounters,
    *,
    model: str,
    settings: Mapping[str, Any],
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.completion_tokens for r in ok)
    latencies = [r.latency_s for r in ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "model": model,
        "settings": dict(settings),
        "requests": {
            "completed": len(ok),
            "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:5],
        },
        "wall_s": wall_s,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "latency_s": {f"p{q}": percentile(latencies, q) for q in PERCENTILES}
        | {"mean": sum(latencies) / len(latencies) if latencies else None},
        "ttft_s": {f"p{q}": percentile(ttfts, q) for q in PERCENTILES} if ttfts else None,
        "acceptance": acceptance_summary(delta),
        "raw_counter_deltas": asdict(delta),
    }


def format_table(report: Mapping[str, Any]) -> str:
    def num(v: Any, fmt: str = ".3f") -> str:
        return "n/a" if v is None else format(v, fmt)

    acc = report["acceptance"]
    lat = report["latency_s"]
    rows = [
        (
            "requests (ok / failed)",
            f"{report['requests']['completed']} / {report['requests']['failed']}",
        ),
        ("mean acceptance length", num(acc["mean_acceptance_length"])),
        ("draft acceptance rate", num(acc["draft_acceptance_rate"])),
        (
            "drafts / draft tokens / accepted",
            f"{acc['num_drafts']:.0f} / {acc['num_draft_tokens']:.0f} / "
            f"{acc['num_accepted_tokens']:.0f}",
        ),
        ("output tokens (from usage)", str(report["output_tokens"])),
        ("output tok/s", num(report["output_tokens_per_s"], ".1f")),
        ("latency p50 / p90 / p99 (s)", " / ".join(num(lat[f"p{q}"]) for q in (50, 90, 99))),
    ]
    if report["ttft_s"]:
        rows.append(
            (
                "TTFT p50 / p90 / p99 (s)",
                " / ".join(num(report["ttft_s"][f"p{q}"]) for q in (50, 90, 99)),
            )
        )
    rows += [
        (f"acceptance at position {i}", num(r))
        for i, r in enumerate(acc["per_position_acceptance_rate"])
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="vllm-dspark bench-acceptance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root, without /v1 (default %(default)s)",
    )
    p.add_argument(
        "--metrics-path",
        default="/metrics",
        help="Prometheus page on the server (default %(default)s)",
    )
    p.add_argument(
        "--model", help="model name to request (default: the server's first /v1/models entry)"
    )
    p.add_argument(
        "--prompts",
        required=True,
        help="prompt file: one prompt per line, or .jsonl with a 'prompt' key",
    )
    p.add_argument(
        "--num-prompts", type=int, help="cycle or cut the prompt file to this many requests"
    )
    p.add_argument(
        "--concurrency", type=int, default=8, help="requests in flight (default %(default)s)"
    )
    p.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (default %(default)s)"
    )
    p.add_argument("--top-p", type=float, help="nucleus sampling (default: the server's)")
    p.add_argument(
        "--max-tokens", type=int, default=512, help="tokens per completion (default %(default)s)"
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate max-tokens for every request (vLLM only)",
    )
    p.add_argument(
        "--stream", action="store_true", help="stream, and report time to first token as well"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY"
    )
    add_shared(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run_benchmark(args)
    # JSON on stdout for files and pipes (`> acceptance.json`), the table on stderr for the terminal.
    print(json.dumps(report, indent=2))
    print(format_table(report), file=sys.stderr)
    return 0 if report["requests"]["completed"] else 1
