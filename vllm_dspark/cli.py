# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark``: one command, one subcommand per tool.

Each subcommand lives in its own module with a ``main(argv) -> int``; the module is imported only
when its subcommand runs, so ``vllm-dspark --help`` stays instant.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "make-random": ("vllm_dspark.make_random", "write a random drafter checkpoint in the real on-disk layout"),
    "draft": ("vllm_dspark.draft", "draft one block per request with the reference drafter"),
    "quantize": ("vllm_dspark.quantize", "quantize a drafter to FP8 / MXFP4 / NVFP4 weight-only (compressed-tensors)"),
    "check": ("vllm_dspark.check", "verify a drafter checkpoint's structure before serving it"),
    "eval": ("vllm_dspark.drift.cli", "measure a quantized drafter's drift from the FP32 reference"),
    "doctor": ("vllm_dspark.doctor", "check a --speculative-config against the drafter and this machine"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: vllm-dspark COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`vllm-dspark COMMAND --help` describes a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from vllm_dspark.version import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"vllm-dspark: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
