# SPDX-License-Identifier: Apache-2.0
"""Every benchmark's smoke run in one process: one cold start of torch and vLLM, not one per benchmark.

    python -m tests.support.bench_smoke OUT

Each benchmark runs as ``python -m benchmarks NAME ARGS`` would (``benchmarks.__main__.run``, its error
boundary included), writing its JSON and table to OUT; its exit code goes to ``OUT/exit_codes.json``
and what it printed to ``OUT/NAME.stdout``. The drift reports are then rendered again from their
report alone (``--render``), after a copy of their first outputs is kept in ``OUT/before-render``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

SMOKE_ARGS: dict[str, list[str]] = {
    "reference": ["--preset", "tiny", "--pairs", "1", "--warmup", "0", "--context-len", "8"],
    "fp8-linear": ["--preset", "tiny", "--pairs", "1", "--warmup", "0"],
    "quantizer": ["--preset", "tiny", "--pairs", "1", "--warmup", "0"],
    "drift-speed": ["--preset", "tiny", "--batch-size", "4", "--pairs", "1", "--warmup", "0"],
    "register": ["--pairs", "1", "--warmup", "0"],
    "check": ["--pairs", "1", "--warmup", "0"],
    "draft-bytes": ["--preset", "prod-geometry-small", "--tp", "4"],
    "drift": ["--preset", "tiny", "--blocks", "8"],
    "drift-positions": ["--preset", "tiny", "--blocks", "4"],
    "pair": [
        "--prompts",
        "2",
        "--max-tokens",
        "4",
        "--blocks",
        "4",
        "--pairs",
        "2",
        "--warmup",
        "0",
    ],
    "draft-kv": ["--prompts", "2", "--max-tokens", "4"],
    "context-sweep": [
        *("--lengths", "16", "64", "--prompts", "2", "--max-tokens", "4", "--variants", "fp32"),
    ],
}
# The reports --render rewrites from their report alone.
RENDERED = ("drift", "drift-positions")


def main(out: Path) -> None:
    os.environ["VLLM_DSPARK_BENCH_RESULTS"] = str(out)  # read when benchmarks.common is imported
    from benchmarks.__main__ import run
    from benchmarks.registry import BENCHMARKS

    codes = {}
    for name, args in SMOKE_ARGS.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            codes[name] = run(name, list(args))
        (out / f"{name}.stdout").write_text(printed.getvalue())
        print(f"{name}: exit {codes[name]}", flush=True)
        if name in RENDERED and codes[name] == 0:
            kept = out / "before-render"
            kept.mkdir(exist_ok=True)
            for path in out.glob(f"{BENCHMARKS[name].result}.*"):
                shutil.copy2(path, kept / path.name)
            with contextlib.redirect_stdout(io.StringIO()):
                codes[f"{name} --render"] = run(name, [*args, "--render"])
    (out / "exit_codes.json").write_text(json.dumps(codes, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
