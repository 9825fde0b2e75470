# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark doctor``'s command line: gathers the facts from this machine and the files, runs
every check and prints the findings (or JSON); exits 1 on any error."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from vllm_dspark.doctor.checks import (
    check_checkpoint_findings,
    check_drafter_config,
    check_vllm_command,
    check_vllm_version,
    diagnose,
    is_k3_drafter,
)
from vllm_dspark.doctor.context import yarn_summary
from vllm_dspark.doctor.facts import (
    AUX_STREAM_ENV,
    engine_facts_of,
    load_drafter,
    machine_facts,
    read_json,
    resolve_target_config,
    unresolved,
    vllm_schema,
)
from vllm_dspark.doctor.torch_builds import torch_build_findings
from vllm_dspark.findings import Finding, errors, most_severe_first, render_table
from vllm_dspark.tools.cli import ArgumentParser, add_shared


def _json_arg(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text}") from None


def _compute_capability(text: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+)?", text.strip()):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a compute capability; use X.Y, e.g. 9.0 (H200) or 10.3 (GB300)"
        )
    return text.strip()


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="vllm-dspark doctor",
        description="Check a DSpark --speculative-config against the drafter checkpoint, the target and this "
        "machine before the target loads. Engine flags use `vllm serve`'s names; pass the ones you serve with.",
    )
    p.add_argument(
        "--speculative-config",
        "-sc",
        required=True,
        type=_json_arg,
        metavar="JSON",
        help="the --speculative-config JSON you pass to vllm serve",
    )
    p.add_argument(
        "--target",
        metavar="MODEL_OR_CONFIG",
        help="the target: a directory or config.json, or an HF id in the local cache",
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="the target's --kv-cache-dtype (default auto)"
    )
    p.add_argument(
        "--compilation-config",
        "-cc",
        type=_json_arg,
        default=None,
        metavar="JSON",
        help="the -cc JSON you serve with (its cudagraph_mode and decode capture sizes matter)",
    )
    p.add_argument(
        "--additional-config",
        type=_json_arg,
        default=None,
        metavar="JSON",
        help="the --additional-config JSON you serve with (its decode_backend matters)",
    )
    p.add_argument("--dtype", default="auto", help="the --dtype you serve with (default auto)")
    p.add_argument(
        "--attention-backend",
        default=None,
        help="the target's --attention-backend you serve with (default: vLLM's pick)",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the --max-model-len you serve with (default: the target's max_position_embeddings)",
    )
    p.add_argument(
        "--compute-capability",
        metavar="X.Y",
        type=_compute_capability,
        help="check against this GPU instead of this machine's (e.g. 10.3 for GB300, 9.0 for H200)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cpu: check a CPU run (`vllm-dspark serve-cpu`), with no GPU advice; cuda: a GPU "
        "run even where no GPU is visible; auto (default): this machine's GPU, else a CPU run "
        "when torch is a CPU build",
    )
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    add_shared(p)
    return p


def run(args: argparse.Namespace) -> tuple[list[Finding], list[str]]:
    """All checks for parsed CLI arguments: (findings, what was checked)."""
    spec = args.speculative_config
    if not isinstance(spec, dict):
        return [
            Finding(
                "must be a JSON object", 'pass \'{"method": "dspark", ...}\'', "speculative_config"
            )
        ], []
    if torch_builds := torch_build_findings():  # importing vLLM would fail on them
        return torch_builds, ["torch builds"]
    schema = vllm_schema()
    findings = check_vllm_version(schema.version) + check_vllm_command()
    checked = [f"vLLM {schema.version}"]
    path, drafter, load_problems = load_drafter(spec)
    findings += load_problems
    if path is not None:
        checked.append(f"drafter {path}")
    if drafter is not None and (yarn := yarn_summary(drafter)):
        checked.append(yarn)
    if path is not None and is_k3_drafter(drafter) and not check_drafter_config(drafter):
        findings += check_checkpoint_findings(
            path
        )  # only a valid config says which tensors to expect
    target = None
    if args.target:
        target_path = resolve_target_config(args.target)
        if target_path is None:
            findings.append(unresolved(args.target, "target", "directory or config.json"))
        else:
            try:
                target = read_json(target_path)
                checked.append(f"target {target_path}")
            except ValueError as e:
                findings.append(
                    Finding(
                        f"{target_path} is not a valid config ({e})",
                        "pass the target's own config.json",
                        "target",
                    )
                )
    machine = machine_facts(args.compute_capability, args.device)
    checked.append(machine.describe())
    engine = engine_facts_of(
        compilation_config=args.compilation_config,
        additional_config=args.additional_config,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager,
        enable_lora=args.enable_lora,
        pipeline_parallel_size=args.pipeline_parallel_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        aux_stream_env=os.environ.get(AUX_STREAM_ENV),
    )
    findings += diagnose(
        spec, drafter=drafter, engine=engine, machine=machine, target=target, schema=schema
    )
    return most_severe_first(findings), checked


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    findings, checked = run(args)
    n_err = len(errors(findings))
    if args.json:
        print(
            json.dumps(
                {"ok": n_err == 0, "checked": checked, "findings": [f.as_dict() for f in findings]},
                indent=2,
            )
        )
    else:
        print("checked: " + "; ".join(checked))
        if findings:
            print(render_table(findings))
        n_warn = sum(f.severity == "warning" for f in findings)
        verdict = "FAIL" if n_err else "OK"
        print(f"{verdict}: {n_err} error(s), {n_warn} warning(s)")
    return 1 if n_err else 0


if __name__ == "__main__":
    from vllm_dspark.tools.cli import main as cli_main

    sys.exit(cli_main(["doctor", *sys.argv[1:]]))
