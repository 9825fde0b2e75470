# SPDX-License-Identifier: Apache-2.0
"""``vllm-dspark quantize``: a drafter to any registered weight-only format, streamed in row chunks, in the
compressed-tensors layout vLLM loads (docs/tools/quantize.md)."""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from vllm_dspark.checkpoint import formats, kv_scales, modelopt, quant_config
from vllm_dspark.checkpoint.layout import (
    FP8_RECIPE,
    REPORT_NAME,
    TARGET_DIR,
    ModuleSpec,
    checkpoint_modules,
    fused_module_groups,
    stored_modules,
    tensor_shapes,
)
from vllm_dspark.checkpoint.quant_plan import QuantPlanError
from vllm_dspark.checkpoint.st_io import (
    Entry,
    SafetensorsWriter,
    StoredTensor,
    pwrite_all,
    read_rows,
    read_tensor,
)
from vllm_dspark.checkpoint.store import (
    CONFIG_NAME,
    INDEX_NAME,
    human_bytes,
    human_params,
    read_checkpoint,
    stored_tensor_specs,
    validate_tensor_shapes,
)
from vllm_dspark.finite import require_finite
from vllm_dspark.safety import (
    check_output,
    copy_tree,
    held_signals,
    refuse_nonempty,
    staged,
)

if TYPE_CHECKING:
    from vllm_dspark.checkpoint_tools.kv_calibration import Calibration
    from vllm_dspark.fields import DrafterFields

EXPORTS = ("compressed-tensors", modelopt.ENCODING)  # the layouts --export writes
# Input bytes per chunk: small enough that the quantizer's passes over it run in cache.
_CHUNK_BYTES = 1 << 19
_thread = threading.local()


class Refusal(ValueError):
    """A request the quantizer turns down; ``vllm-dspark`` prints it as one line and exits 2."""


@dataclass(frozen=True)
class ModuleStats:
    """One quantized module's line in the report."""

    module: str
    kind: str
    layer: int | None
    format: str
    params: int
    bytes_before: int
    bytes_after: int
    snr_db: float


@dataclass(frozen=True)
class _Item:
    """One input tensor: copied as is, or quantized as ``module`` in ``fmt``."""

    key: str
    stored: StoredTensor
    module: ModuleSpec | None = None
    fmt: str | None = None
    encoding: str = "compressed-tensors"

    def outputs(self) -> list[Entry]:
        if self.fmt is None:
            return [self.stored.entry(self.key)]
        return [
            Entry.planned(f"{self.module.name}.{suffix}", spec.dtype, spec.shape)
            for suffix, spec in self.part_specs().items()
        ]

    def part_specs(self) -> dict[str, formats.TensorSpec]:
        """The tensors it writes: its format's, the optional ones left out."""
        specs = stored_tensor_specs(self.fmt, self.module.shape, self.encoding)
        return {suffix: spec for suffix, spec in specs.items() if not spec.optional}


@dataclass(frozen=True)
class _Plan:
    source_config_json: dict[str, Any]  # the input's config.json
    config: DrafterFields
    kinds: tuple[str, ...]  # the included module kinds
    shards: dict[
        str, list[_Item]
    ]  # output shard name -> its tensors, as the input shards hold them
    encoding: str = "compressed-tensors"  # or "modelopt": whose layout the output takes

    def config_json(self, fmt: str) -> dict[str, Any]:
        """The output's config.json: the input's with its ``quantization_config``."""
        if self.encoding == modelopt.ENCODING:
            kept = [s.name for s in checkpoint_modules(self.config) if s.kind not in self.kinds]
            qc = modelopt.quantization_config(fmt, modelopt.exclude_entries(kept))
        else:
            qc = quant_config.quantization_config(fmt, self.kinds, self.config)
        return dict(self.source_config_json, quantization_config=qc)


def _plan(model_dir: Path, fmt: str, include_layers: Sequence[str], encoding: str) -> _Plan:
    """Validate the request against the checkpoint, before anything is written."""
    checkpoint = read_checkpoint(model_dir, fields_only=True)
    config, stored = checkpoint.config, checkpoint.stored
    try:
        quantized = checkpoint.plan().modules
    except QuantPlanError as e:
        raise Refusal(f"{model_dir} is not a BF16 checkpoint: {e}") from None
    if quantized or checkpoint.quantization_config is not None:
        found = ", ".join(sorted(set(quantized.values()))) or "no-op"
        raise Refusal(
            f"{model_dir} is already quantized ({len(quantized)} modules stored as {found}, per its "
            "quantization_config and tensors). Quantize the BF16 checkpoint instead; quantizing twice "
            "compounds the error."
        )
    kinds = quant_config.validate_include_kinds(include_layers, fmt, config)
    if encoding == modelopt.ENCODING and formats.get(fmt).modelopt_algo is None:
        raise Refusal(
            f"--export modelopt writes {', '.join(modelopt.algos().values())} (ModelOpt's "
            f"{', '.join(modelopt.algos())}), not {fmt}"
        )
    validate_tensor_shapes(
        {k: t.shape for k, t in stored.items()},
        tensor_shapes(config),
        source=f"checkpoint {model_dir}",
        config=config,
    )
    items = []
    for spec in stored_modules(config, stored):
        key = f"{spec.name}.weight"
        items.append(
            _Item(key, stored[key], spec, fmt, encoding)
            if spec.kind in kinds
            else _Item(key, stored[key])
        )
        if spec.bias:
            items.append(_Item(f"{spec.name}.bias", stored[f"{spec.name}.bias"]))
    shards: dict[str, list[_Item]] = {}
    for item in items:
        shards.setdefault(item.stored.path.name, []).append(item)
    return _Plan(checkpoint.config_json, config, kinds, dict(sorted(shards.items())), encoding)


def _read(source: StoredTensor, key: str) -> torch.Tensor:
    tensor = read_tensor(source.path, key)
    # A NaN or Inf weight would quantize to NaN scales: refuse it by name instead.
    require_finite(
        tensor,
        f"source tensor {key} in {source.path}",
        "repair or re-export the BF16 checkpoint; quantization cannot represent NaN or Inf",
    )
    return tensor


def _global_scales(items: list[_Item], device: str) -> dict[str, torch.Tensor]:
    """Each module's global scale, for formats that share one when fused: shared by a fused group (gate/up per layer,
    q_a/kv_a across layers), else the module's own. Computed up front, as chunks cannot see the rest.
    ModelOpt's layout shares the group's amax instead, as its fused-layer export does."""
    quantized = {
        item.module.name: item
        for item in items
        if item.fmt and formats.get(item.fmt).fused_shares_scale
    }
    groups = list(fused_module_groups(quantized).values())
    grouped = {m for members in groups for m in members}
    groups += [[m] for m in quantized if m not in grouped]
    scales = {}
    for members in groups:
        first = quantized[members[0]]
        share = (
            modelopt.group_amax
            if first.encoding == modelopt.ENCODING
            else formats.get(first.fmt).shared_global_scale
        )
        tensors = (_read(quantized[m].stored, quantized[m].key).to(device) for m in members)
        scales.update(dict.fromkeys(members, share(tensors)))
    return scales


def _rows(item: _Item) -> list[slice]:
    """The row chunks one tensor streams in: one chunk for a format whose rows are not independent."""
    shape = item.stored.shape
    n = shape[0] if shape else 1
    if item.fmt is not None and not formats.get(item.fmt).row_separable:
        return [slice(0, n)]
    # A block format's chunks hold whole blocks of rows (each block has one row of scales).
    align = formats.get(item.fmt).row_block if item.fmt else 1
    step = max(1, _CHUNK_BYTES // max(item.stored.nbytes // max(n, 1), 1) // align) * align
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _chunk(
    item: _Item,
    rows: slice,
    src: int,
    fd: int,
    offsets: dict[str, int],
    device: str,
    global_scales: dict[str, torch.Tensor],
) -> tuple[float, float]:
    """Read, quantize or check, and write one row chunk of one tensor; its error sums (0 if copied)."""
    if not hasattr(_thread, "buffer"):  # one read buffer per thread: no fresh pages per chunk
        _thread.buffer = torch.empty(_CHUNK_BYTES, dtype=torch.uint8)
    x = read_rows(item.stored, rows, _thread.buffer, src)
    if item.fmt is None:
        # A float sum is finite unless a value is NaN or Inf (or the sum overflows: then look closer),
        # and it is many times faster than isfinite on BF16.
        if x.is_floating_point() and not math.isfinite(float(x.sum(dtype=torch.float32))):
            _read(item.stored, item.key)  # raises, naming the tensor and counting its bad values
        pwrite_all(fd, x, offsets[item.key] + rows.start * (x.nbytes // len(x)))
        return 0.0, 0.0
    spec = item.module
    if item.encoding == modelopt.ENCODING:
        parts, signal, noise = _modelopt_with_error(
            x.to(device), item.fmt, global_scales.get(spec.name)
        )
    else:
        parts, signal, noise = formats.get(item.fmt).quantize_with_error(
            x.to(device), global_scale=global_scales.get(spec.name)
        )
    if not math.isfinite(signal):  # a NaN or Inf weight, or a sum of squares that overflowed
        _read(item.stored, item.key)
    for suffix, part_spec in item.part_specs().items():
        key = f"{spec.name}.{suffix}"
        # A row per weight row or per block of them (2-D), or one per row (ModelOpt's [N] scales).
        if len(part_spec.shape) == 2 or part_spec.shape == spec.shape[:1]:
            per = spec.shape[0] // part_spec.shape[0]
            row_bytes = math.prod(part_spec.shape[1:]) * part_spec.dtype.itemsize
            pwrite_all(fd, parts[suffix], offsets[key] + rows.start // per * row_bytes)
        elif rows.start == 0:  # a whole-tensor part (the global scale): every chunk has it
            pwrite_all(fd, parts[suffix], offsets[key])
    return signal, noise


def _modelopt_with_error(
    x: torch.Tensor, fmt: str, amax: torch.Tensor | None
) -> tuple[dict[str, torch.Tensor], float, float]:
    """ModelOpt's tensors for row chunk ``x`` (under the module's or group's ``amax``), with its error sums."""
    parts = modelopt.quantize(x, fmt, amax=amax)
    ref = x.float().flatten()
    diff = ref - modelopt.dequantize(parts, fmt, tuple(x.shape)).flatten()
    return parts, float(torch.dot(ref, ref)), float(torch.dot(diff, diff))


def _copy_other_files(model_dir: Path, staging: Path) -> None:
    """Copy what is not weights or config (tokenizer, README, the target's shared heads) along."""
    for path in model_dir.iterdir():
        if (
            path.is_file()
            and path.name not in (CONFIG_NAME, INDEX_NAME)
            and path.suffix != ".safetensors"
        ):
            shutil.copy2(path, staging / path.name)
    if (model_dir / TARGET_DIR).is_dir():
        copy_tree(model_dir / TARGET_DIR, staging / TARGET_DIR)


def _summarise(
    fmt: str,
    kinds: Sequence[str],
    modules: list[ModuleStats],
    stored: dict[str, StoredTensor],
    bytes_after: int,
    seconds: float,
) -> dict[str, Any]:
    params_total = sum(math.prod(t.shape) for t in stored.values())
    params_quantized = sum(m.params for m in modules)
    bytes_before = sum(t.nbytes for t in stored.values())
    per_kind = []
    for kind in dict.fromkeys(m.kind for m in modules):
        of_kind = [m for m in modules if m.kind == kind]
        per_kind.append(
            {
                "kind": kind,
                "modules": len(of_kind),
                "params": sum(m.params for m in of_kind),
                "snr_db_mean": sum(m.snr_db for m in of_kind) / len(of_kind),
                "snr_db_min": min(m.snr_db for m in of_kind),
            }
        )
    snrs = [m.snr_db for m in modules]
    return {
        "format": fmt,
        "include_layers": list(kinds),
        "overall": {
            "modules_quantized": len(modules),
            "params_total": params_total,
            "params_quantized": params_quantized,
            "fraction_quantized": params_quantized / params_total,
            "bytes_before": bytes_before,
            "bytes_after": bytes_after,
            "gib_before": bytes_before / 2**30,
            "gib_after": bytes_after / 2**30,
            "snr_db_mean": sum(snrs) / len(snrs),
            "snr_db_min": min(snrs),
            "seconds": seconds,
            "input_gb_per_s": bytes_before / seconds / 1e9,
        },
        "per_kind": per_kind,
        "modules": [asdict(m) for m in modules],
    }


def _report_markdown(report: dict[str, Any]) -> str:
    o = report["overall"]
    lines = [
        f"# Quantization report: {report['format']} weight-only",
        "",
        f"{human_params(o['params_quantized'])} of {human_params(o['params_total'])} params quantized "
        f"({100 * o['fraction_quantized']:.1f} %), {o['modules_quantized']} modules; "
        f"{human_bytes(o['bytes_before'])} -> {human_bytes(o['bytes_after'])}; "
        f"weight SNR mean {o['snr_db_mean']:.2f} dB, min {o['snr_db_min']:.2f} dB.",
        "",
        "| kind | modules | params | SNR mean dB | SNR min dB |",
        "|---|---|---|---|---|",
        *(
            f"| {k['kind']} | {k['modules']} | {k['params']:,} | {k['snr_db_mean']:.2f} | {k['snr_db_min']:.2f} |"
            for k in report["per_kind"]
        ),
        "",
        "| module | params | MiB before | MiB after | SNR dB |",
        "|---|---|---|---|---|",
        *(
            f"| {m['module']} | {m['params']:,} | {m['bytes_before'] / 2**20:.2f} | {m['bytes_after'] / 2**20:.2f} "
            f"| {m['snr_db']:.2f} |"
            for m in report["modules"]
        ),
    ]
    return "\n".join(lines) + "\n"


def _write_quantized(
    plan: _Plan, staging: Path, fmt: str, device: str, workers: int, progress: bool
) -> dict[str, Any]:
    """Stream every tensor of ``plan`` through the quantizer into ``staging``; returns the report.

    Each shard's header goes first; then ``workers`` threads each take row chunks in turn, read
    them with ``pread``, quantize (or check) them and ``pwrite`` them into place, so memory stays
    at a few chunks and every core is busy (torch and file I/O release the GIL).
    """
    start = time.perf_counter()
    items = [item for shard_items in plan.shards.values() for item in shard_items]
    global_scales = _global_scales(items, device)
    modules: list[ModuleStats] = []
    weight_map: dict[str, str] = {}
    with ExitStack() as stack:
        shards = []
        for shard_name, shard_items in plan.shards.items():
            entries = [e for item in shard_items for e in item.outputs()]
            shard = stack.enter_context(SafetensorsWriter(staging / shard_name, entries))
            shards.append((shard, shard.claim_rest(), shard_items))
            weight_map.update(dict.fromkeys((e.key for e in entries), shard_name))
        sources = {}  # one descriptor per input file, so the kernel's readahead sees one stream
        for path in dict.fromkeys(item.stored.path for item in items):
            sources[path] = os.open(path, os.O_RDONLY)
            stack.callback(os.close, sources[path])
            os.posix_fadvise(sources[path], 0, 0, os.POSIX_FADV_SEQUENTIAL)
        pool = stack.enter_context(ThreadPoolExecutor(workers, thread_name_prefix="quantize"))
        # Unwound first: on error, drop the chunks not started before the writers abort their files.
        stack.callback(pool.shutdown, wait=True, cancel_futures=True)
        with held_signals():  # an interrupt inside Thread.start leaves a thread no shutdown joins
            jobs = [
                (
                    item,
                    [
                        pool.submit(
                            _chunk,
                            item,
                            r,
                            sources[item.stored.path],
                            shard.fileno(),
                            offsets,
                            device,
                            global_scales,
                        )
                        for r in _rows(item)
                    ],
                )
                for shard, offsets, shard_items in shards
                for item in shard_items
            ]
        with tqdm(
            total=sum(i.stored.nbytes for i in items),
            unit="B",
            unit_scale=True,
            desc=f"quantize {fmt}",
            disable=None if progress else True,
        ) as bar:
            for item, chunks in jobs:
                sums = [c.result() for c in chunks]
                if item.fmt is not None:
                    modules.append(_stats(item, *map(sum, zip(*sums))))
                bar.update(item.stored.nbytes)
    total = sum(e.nbytes for item in items for e in item.outputs())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config_json = plan.config_json(fmt)
    (staging / CONFIG_NAME).write_text(json.dumps(config_json, indent=2) + "\n")
    if plan.encoding == modelopt.ENCODING:
        hf_quant = modelopt.hf_quant_config(config_json["quantization_config"])
        (staging / modelopt.HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2) + "\n")
    stored = {item.key: item.stored for item in items}
    return _summarise(fmt, plan.kinds, modules, stored, total, time.perf_counter() - start)


def _stats(item: _Item, signal: float, noise: float) -> ModuleStats:
    spec = item.module
    return ModuleStats(
        module=spec.name,
        kind=spec.kind,
        layer=spec.layer,
        format=item.fmt,
        params=math.prod(spec.shape),
        bytes_before=item.stored.nbytes,
        bytes_after=sum(e.nbytes for e in item.outputs()),
        snr_db=formats.snr_db(signal, noise),
    )


def quantize_checkpoint(
    model_dir: str | Path,
    output_dir: str | Path,
    fmt: str,
    include_layers: Sequence[str] = FP8_RECIPE,
    *,
    device: str = "cpu",
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    export: str = "compressed-tensors",
    kv_cache_scheme: str | None = None,
    kv_calibration: str | Path | None = None,
) -> dict[str, Any]:
    """Quantize the drafter in ``model_dir`` into ``output_dir``; returns the report dict.

    ``export`` is the layout written: compressed-tensors', or ModelOpt's ("modelopt": its tensor names,
    scales and config, for fp8-static, fp8-dynamic, nvfp4-w4a4 and nvfp4). ``kv_cache_scheme="fp8"``
    also writes each draft layer's static FP8 KV-cache scale, calibrated from ``kv_calibration`` (a
    target model directory or an aux-state file; default: the target beside ``model_dir``, as
    ``train-pair`` lays the pair out).

    Raises :class:`Refusal` (a ``ValueError``) for anything it will not do, before writing. The
    output is assembled in a staging directory next to ``output_dir`` and moved into place only
    when complete, so a failed run leaves no half-written checkpoint.
    """
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    workers = len(os.sched_getaffinity(0)) if workers is None else workers
    if workers < 1:
        raise Refusal(f"--workers must be at least 1, got {workers}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Refusal("--device cuda, but torch sees no CUDA device; use --device cpu")
    check_output(output_dir, [model_dir], flag="--out")
    refuse_nonempty(output_dir, overwrite=overwrite, flag="--out")
    if export not in EXPORTS:
        raise Refusal(f"--export must be one of {', '.join(EXPORTS)}, not {export!r}")
    plan = _plan(model_dir, fmt, include_layers, export)
    calibration = _kv_calibration(model_dir, kv_cache_scheme, kv_calibration, export, progress)
    threads = torch.get_num_threads()
    try:
        # Workers split the cores between them instead of each fanning out over all of them.
        torch.set_num_threads(max(1, threads // workers))
        with staged(output_dir, directory=True) as staging, ThreadPoolExecutor(1) as side:
            # The other files (the target's heads: GiBs) copy in the kernel meanwhile.
            with held_signals():
                others = side.submit(_copy_other_files, model_dir, staging)
            # Process-global: held for the run so no worker's own stance lapses while another's is set
            # (entering it imports torch._dynamo, a second's work, so only formats that need it do).
            eager = formats.get(fmt).compiled_kernels
            with torch.compiler.set_stance("force_eager") if eager else nullcontext():
                report = _write_quantized(plan, staging, fmt, device, workers, progress)
            others.result()
            if calibration is not None:
                report["kv_cache"] = _write_kv_scales(staging, calibration)
            (staging / f"{REPORT_NAME}.json").write_text(json.dumps(report, indent=2) + "\n")
            (staging / f"{REPORT_NAME}.md").write_text(_report_markdown(report))
    finally:
        torch.set_num_threads(threads)
    return report


def _kv_calibration(
    model_dir: Path,
    scheme: str | None,
    source: str | Path | None,
    export: str,
    progress: bool,
) -> Calibration | None:
    """The draft layers' calibrated KV-cache scales ``--kv-cache-scheme`` asks for, before anything is written."""
    if scheme is None:
        if source is not None:
            raise Refusal("--kv-calibration calibrates KV-cache scales: add --kv-cache-scheme fp8")
        return None
    if scheme != "fp8":
        raise Refusal(f"--kv-cache-scheme takes fp8 (static per-layer E4M3 scales), not {scheme!r}")
    if export != "compressed-tensors":
        raise Refusal(
            "--kv-cache-scheme writes compressed-tensors' KV scales: drop --export modelopt"
        )
    default = model_dir.resolve().parent / TARGET_DIR
    if source is None and not (default / CONFIG_NAME).is_file():
        raise Refusal(
            f"--kv-cache-scheme fp8 calibrates from the target's aux states, and {default} holds no "
            "target: pass --kv-calibration with the target model directory or an aux-state "
            ".safetensors file"
        )
    from vllm_dspark.checkpoint_tools.kv_calibration import calibrate

    return calibrate(model_dir, Path(source) if source is not None else default, progress=progress)


def _write_kv_scales(staging: Path, calibration: Calibration) -> dict[str, Any]:
    """Add the KV-cache scales' shard, its index entries and ``kv_cache_scheme`` to ``staging``."""
    entries, tensors = [], {}
    for layer, scale in enumerate(calibration.k_scales.tolist()):
        for key in kv_scales.scale_keys(layer):
            tensors[key] = torch.tensor(scale, dtype=torch.float32)
            entries.append(Entry.of(key, tensors[key]))
    with SafetensorsWriter(staging / kv_scales.SHARD_NAME, entries) as shard:
        for entry in entries:
            shard.write(entry.key, tensors[entry.key])
    index = json.loads((staging / INDEX_NAME).read_text())
    index["weight_map"] = dict(
        sorted({**index["weight_map"], **dict.fromkeys(tensors, kv_scales.SHARD_NAME)}.items())
    )
    index["metadata"]["total_size"] += sum(e.nbytes for e in entries)
    (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config_json = json.loads((staging / CONFIG_NAME).read_text())
    config_json["quantization_config"]["kv_cache_scheme"] = dict(kv_scales.KV_CACHE_SCHEME)
    (staging / CONFIG_NAME).write_text(json.dumps(config_json, indent=2) + "\n")
    return {
        "scheme": "fp8",
        "k_scales": calibration.k_scales.tolist(),
        "amax": calibration.amax.tolist(),
        "source": calibration.source,
    }
