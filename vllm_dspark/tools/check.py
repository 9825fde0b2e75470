# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark check``: a drafter checkpoint's structure, verified without loading its weights."""

from __future__ import annotations

import sys

from vllm_dspark.tools.cli import ArgumentParser, add_model, add_shared


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="vllm-dspark check",
        description="Verify a K3 DSpark drafter checkpoint's structure (config, shards, quantization_config, "
        "every tensor's dtype and shape, scales) without loading its weights. Exits 1 on any problem.",
    )
    add_model(parser, "the drafter checkpoint directory", positional=True)
    add_shared(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vllm_dspark.checkpoint.check import check_checkpoint

    report = check_checkpoint(args.model)
    print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    from vllm_dspark.tools.cli import main as cli_main

    sys.exit(cli_main(["check", *sys.argv[1:]]))
