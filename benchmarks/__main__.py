# SPDX-License-Identifier: Apache-2.0
"""``python -m benchmarks NAME [ARGS]``: every benchmark prints a table and writes JSON + markdown
to benchmarks/results/.

``python -m benchmarks all`` runs the speed suite, each benchmark at the size whose results are
committed (about 17 minutes on two cores). The two drift reports are quality measurements that need
hundreds of blocks for tight confidence intervals (about 55 and 40 minutes); they run by name.
"""

from __future__ import annotations

import importlib
import sys
import time

from benchmarks.common import format_table, write_result
from benchmarks.registry import BENCHMARKS
from vllm_dspark.tools.cli import debug_requested, guarded


def run(name: str, extra: list[str]) -> int:
    """One benchmark inside the tools' error boundary: bad arguments get one line, exit 2."""
    bench = BENCHMARKS[name]
    debug, extra = debug_requested(extra)
    return guarded(
        f"python -m benchmarks {name}",
        lambda: importlib.import_module(bench.module).main([*bench.args, *extra]),
        debug=debug,
    )


def run_all() -> int:
    """Run the speed suite and write its wall times (``suite.json``): the suite's own time is a goal."""
    rows = []
    for name in (k for k, b in BENCHMARKS.items() if b.in_all):
        print(f"== {name}")
        start = time.perf_counter()
        rc = run(name, [])
        rows.append({"benchmark": name, "minutes": (time.perf_counter() - start) / 60})
        if rc:
            return rc
    total = sum(r["minutes"] for r in rows)
    rows.append({"benchmark": "all", "minutes": total})
    write_result(
        "suite",
        {"minutes": {r["benchmark"]: r["minutes"] for r in rows}, "total_s": 60 * total},
        format_table(rows, ["benchmark", "minutes"]),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, BENCHMARKS))
        print("usage: python -m benchmarks {all,readme," + ",".join(BENCHMARKS) + "} [ARGS]\n")
        print(
            f"  {'all':<{width}}  the speed suite: "
            + ", ".join(k for k, b in BENCHMARKS.items() if b.in_all)
        )
        print("\n".join(f"  {k:<{width}}  {b.help}" for k, b in BENCHMARKS.items()))
        print(
            f"  {'readme':<{width}}  regenerate the README's goals and quality tables and docs/benchmarks.md from benchmarks/results/"
        )
        return 0
    if argv[0] == "readme":
        from benchmarks.readme import main as readme_main

        return readme_main(argv[1:])
    if argv[0] == "all":
        return run_all()
    if argv[0] not in BENCHMARKS:
        print(
            f"unknown benchmark {argv[0]!r}; choose from all, readme, {', '.join(BENCHMARKS)}",
            file=sys.stderr,
        )
        return 2
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
