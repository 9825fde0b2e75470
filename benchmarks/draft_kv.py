# SPDX-License-Identifier: Apache-2.0
"""The trained pair: measured acceptance with the draft's KV cache in BF16 and in FP8 E4M3.

vLLM's fp8 MLA cache stores each draft latent as E4M3 of latent / k_scale; a checkpoint without KV
scales gets k_scale 1.0 (tokenspeed#1012: τ 2.7 -> 1.79 with fp8 draft KV at 1.0). This runs
``vllm-dspark accept`` (greedy, the held-out prompts of ``python -m benchmarks pair``) on the BF16 and
FP8 drafters with a BF16 draft KV cache, then with an FP8 one at k_scale 1.0 and with the per-layer
scales ``quantize --kv-cache-scheme fp8`` calibrates (from the pair's target over the package's
corpus, not the prompts measured). The BF16 drafter with scales is the BF16 checkpoint plus the
FP8 build's scale shard. Writes ``benchmarks/results/draft_kv/`` (both accept reports) and
``benchmarks/results/draft_kv.{json,md}``:

    python -m benchmarks draft-kv
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, write_result
from vllm_dspark.safety import copy_tree, staged

PAIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "pair"
WEIGHTS = ("bf16", "fp8")
KV = (
    ("bf16", "BF16 KV"),
    ("fp8 at 1.0", "FP8 KV, k_scale 1.0"),
    ("fp8 calibrated", "FP8 KV, calibrated k_scale"),
)


def _pm(est: dict[str, float]) -> str:
    return f"{est['value']:.2f} ± {(est['hi'] - est['lo']) / 2:.2f}"


def builds(pair: Path, root: Path) -> dict[str, Path]:
    """``{weights: drafter directory with calibrated KV scales}``: the FP8 build ``quantize
    --kv-cache-scheme fp8`` writes, and the BF16 checkpoint given that build's scale shard."""
    from vllm_dspark.checkpoint import kv_scales
    from vllm_dspark.checkpoint.store import INDEX_NAME
    from vllm_dspark.tools.cli import main as cli

    fp8 = root / "fp8-calibrated-kv"
    argv = ["quantize", "--model-dir", str(pair / "drafter"), "--out", str(fp8)]
    if cli([*argv, "--quant-format", "fp8", "--kv-cache-scheme", "fp8", "--no-progress"]) != 0:
        raise SystemExit(1)
    bf16 = root / "bf16-calibrated-kv"
    copy_tree(pair / "drafter", bf16)
    (bf16 / kv_scales.SHARD_NAME).write_bytes((fp8 / kv_scales.SHARD_NAME).read_bytes())
    index = json.loads((bf16 / INDEX_NAME).read_text())
    fp8_index = json.loads((fp8 / INDEX_NAME).read_text())["weight_map"]
    scales = {k: v for k, v in fp8_index.items() if kv_scales.is_kv_scale(k)}
    index["weight_map"] = dict(sorted({**index["weight_map"], **scales}.items()))
    (bf16 / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return {"bf16": bf16, "fp8": fp8}


def rows(reports: dict[str, dict[str, Any]], calibrated: dict[str, Path]) -> list[dict[str, Any]]:
    """One row per weight format: τ under each draft KV cache, the scales used, losslessness."""
    names = {str(v.name): w for w, v in calibrated.items()}
    out = []
    for weights in WEIGHTS:
        row: dict[str, Any] = {"weights": weights, "tau": {}, "lossless": {}, "k_scales": {}}
        for kv, report in reports.items():
            for cell in report["cells"]:
                owner = names.get(cell["variant"], cell["variant"])
                calibrated_cell = cell["variant"] in names
                if owner != weights or (kv == "fp8 calibrated") != calibrated_cell:
                    continue
                row["tau"][kv] = cell["tau"]
                row["lossless"][kv] = cell["lossless"]
                row["k_scales"][kv] = cell["draft_kv"].get("k_scales")
        out.append(row)
    return out


def table(payload: dict[str, Any]) -> str:
    header = ["Weights", *(h for _, h in KV), "Lossless"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in payload["rows"]:
        lossless = [x for kv, _ in KV for x in r["lossless"][kv]]
        lines.append(
            f"| {r['weights']} | "
            + " | ".join(_pm(r["tau"][kv]) for kv, _ in KV)
            + f" | {sum(lossless)}/{len(lossless)} |"
        )
    scales = ", ".join(f"{s:.4f}" for s in payload["rows"][-1]["k_scales"]["fp8 calibrated"])
    c = payload["accept_config"]
    note = (
        f"Greedy, {c['num_prompts']} held-out prompts, {c['max_tokens']} tokens each; ± is the 95 % "
        f"bootstrap CI over prompts. Calibrated k_scale per draft layer: {scales} "
        f"({payload['calibration']}). `accept` runs: {payload['seconds']:.0f} s in all."
    )
    return "\n".join(lines) + "\n\n" + note


def main(argv: list[str] | None = None) -> int:
    from vllm_dspark.tools.cli import main as cli

    parser = argparse.ArgumentParser(prog="python -m benchmarks draft-kv", description=__doc__)
    parser.add_argument("--pair", type=Path, default=PAIR, help="a train-pair output directory")
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts accept decodes")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    # Paths relative to the working directory: results record where the pair is, not this machine.
    pair, out = Path(os.path.relpath(args.pair)), args.out / "draft_kv"
    prompts = json.loads((pair / "heldout_prompts.json").read_text())["prompts"][: args.prompts]
    scratch = tempfile.TemporaryDirectory(prefix="draft-kv-builds-")
    calibrated = builds(pair, Path(scratch.name))
    ids = Path(os.path.relpath(out / "prompts.json"))
    with staged(ids, directory=False) as staging:
        staging.write_text(json.dumps([p["token_ids"] for p in prompts]) + "\n")
    common = ["accept", "--target", str(pair / "target"), "--drafter", str(pair / "drafter")]
    common += ["--prompts", str(ids), "--max-tokens", str(args.max_tokens), "--no-progress"]
    runs = {
        "bf16": ["--variants", *WEIGHTS, "--draft-kv", "bf16"],
        # One fp8 run: the on-the-fly variants find no scales (1.0), the builds carry theirs.
        "fp8": ["--variants", *WEIGHTS, *map(str, calibrated.values()), "--draft-kv", "fp8"],
    }
    reports = {}
    t0 = time.perf_counter()
    for kv, extra in runs.items():
        if cli([*common, *extra, "--out", str(out / kv)]) != 0:
            return 1
        reports[kv] = json.loads((out / kv / "results.json").read_text())
    seconds = time.perf_counter() - t0
    fp8 = reports.pop("fp8")
    reports["fp8 at 1.0"] = {"cells": [c for c in fp8["cells"] if "1.0" in c["draft_kv"]["scales"]]}
    reports["fp8 calibrated"] = {
        "cells": [c for c in fp8["cells"] if "1.0" not in c["draft_kv"]["scales"]]
    }
    report = json.loads(
        (Path(scratch.name) / "fp8-calibrated-kv" / "quantization_report.json").read_text()
    )
    payload = {
        "pair": str(pair),
        "accept_config": fp8["config"],
        "calibration": report["kv_cache"]["source"].replace(str(pair.resolve()), str(pair)),
        "seconds": seconds,
        "rows": rows(reports, calibrated),
    }
    scratch.cleanup()
    write_result("draft_kv", payload, table(payload), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
