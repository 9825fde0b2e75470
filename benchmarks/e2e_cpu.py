# SPDX-License-Identifier: Apache-2.0
"""vLLM's ``dspark`` speculator end to end on CPU: spec-decode counters and interpreter tokens/s.

Runs ``tests/dspark_e2e.py --platform cpu`` (the run the end-to-end tests check: the trained pair of
``tests/data/pair``, BF16 and FP8 drafters, on short held-out prompts) and tabulates, per engine,
vLLM's counters (drafts, drafted and accepted tokens, acceptance per position) and output tokens per
second. The acceptance is the engine's; ``vllm-dspark accept`` measures the same on these prompts
(the tests check they agree). Tokens/s are those of Model Runner V2 under Triton's interpreter on
this machine: context, not a goal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import format_table, write_result

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = [
    "engine",
    "drafts",
    "draft tokens",
    "accepted",
    "accepted per position",
    "output tokens",
    "generate s",
    "output tok/s",
]


def rows(results: dict) -> list[dict]:
    """One table row per engine of a ``tests/dspark_e2e.py`` results.json."""
    table = []
    for engine in ("baseline", "bf16", "fp8", "probabilistic"):
        run = results[engine]
        counters = run.get("counters", {})
        tokens = sum(len(o["tokens"]) for o in run["outputs"])
        table.append(
            {
                "engine": {
                    "baseline": "no speculation",
                    "probabilistic": "bf16, probabilistic + block",
                }.get(engine, engine),
                "drafts": counters.get("vllm:spec_decode_num_drafts", "-"),
                "draft tokens": counters.get("vllm:spec_decode_num_draft_tokens", "-"),
                "accepted": counters.get("vllm:spec_decode_num_accepted_tokens", "-"),
                "accepted per position": " ".join(
                    str(int(v))
                    for v in counters.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
                )
                or "-",
                "output tokens": tokens,
                "generate s": run["generate_seconds"],
                "output tok/s": tokens / run["generate_seconds"],
            }
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks e2e-cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        metavar="DIR",
        help="tabulate an existing `tests/dspark_e2e.py --out DIR` run instead of running one",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source = args.source
        if source is None:
            from tests.dspark_e2e import build_models

            build_models(Path(tmp))
            source = Path(tmp) / "out"
            env = {
                **os.environ,
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            }
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tests.dspark_e2e",
                    "--platform",
                    "cpu",
                    "--models",
                    tmp,
                    "--out",
                    str(source),
                ],
                cwd=ROOT,
                env=env,
                check=True,
            )
        results = json.loads((source / "results.json").read_text())
    table = rows(results)
    settings = {k: results[k] for k in ("platform", "block", "prompts", "max_tokens")}
    write_result("e2e_cpu", {"settings": settings, "rows": table}, format_table(table, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
