# SPDX-License-Identifier: Apache-2.0
"""Safetensors files: one header reader, one tensor reader and one header-first writer.

The header reader and :data:`DTYPES` need only the standard library (``vllm-dspark check`` imports
no torch); tensors are read and written through torch, imported where they are.

A file is an 8-byte little-endian header length, a JSON header ``{key: {dtype, shape,
data_offsets}}`` and the data, each tensor's ``[begin, end)`` counted from the end of the header.
The writer is given every tensor's :class:`Entry` before its first byte, so the header goes first
and each tensor streams to its place once; the file is built beside its target and renamed into
place only when complete (:func:`vllm_dspark.safety.staged`). :func:`library_order` plans entries
as the safetensors library's own writer (``save_file``) lays them out, so a file written in that
order with the same metadata is that writer's file byte for byte (the published drafter's layout).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_dspark.findings import Finding, FindingError, os_error_finding

if TYPE_CHECKING:
    import torch

# Every safetensors dtype, in its Rust crate's ``Dtype`` enum order (checked at 0.8): its bits per element,
# and the torch dtype's name where this project reads or writes tensors of it. The header reader and
# ``vllm-dspark check`` work on these names alone, without importing torch.
DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (8, "bool"),
    "F4": (4, None),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
    "U8": (8, "uint8"),
    "I8": (8, "int8"),
    "F8_E5M2": (8, "float8_e5m2"),
    "F8_E4M3": (8, "float8_e4m3fn"),
    "F8_E8M0": (8, None),
    "F8_E4M3FNUZ": (8, None),
    "F8_E5M2FNUZ": (8, None),
    "I16": (16, "int16"),
    "U16": (16, "uint16"),
    "F16": (16, "float16"),
    "BF16": (16, "bfloat16"),
    "I32": (32, "int32"),
    "U32": (32, "uint32"),
    "F32": (32, "float32"),
    "C64": (64, None),
    "F64": (64, "float64"),
    "I64": (64, "int64"),
    "U64": (64, "uint64"),
}
_NAMES = {f"torch.{named}": name for name, (_, named) in DTYPES.items() if named}
# The library's writer sorts tensors by dtype, descending in this order (widest alignment first), then by name.
_LIBRARY_DTYPE_RANK = {name: i for i, name in enumerate(DTYPES)}
_MAX_HEADER_BYTES = 100_000_000  # the library's limit


def dtype_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of a torch dtype (``F8_E4M3``), or None if this project does not store it."""
    return _NAMES.get(str(dtype))


def torch_name(name: str) -> str:
    """torch's name for a safetensors dtype (``float8_e4m3fn``); ``KeyError`` for one torch is not used for."""
    named = DTYPES[name][1]
    if named is None:
        raise KeyError(name)
    return named


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (imports torch)."""
    import torch

    return getattr(torch, torch_name(name))


# What this project's files carry unless told otherwise: the marker transformers' save_pretrained writes.
DEFAULT_METADATA: Mapping[str, str] = {"format": "pt"}


@dataclass(frozen=True)
class Entry:
    """One tensor as a header lists it."""

    key: str
    dtype: str  # safetensors dtype name: BF16, F8_E4M3, U8, ...
    shape: tuple[int, ...]
    nbytes: int

    @classmethod
    def planned(cls, key: str, dtype: torch.dtype, shape: Sequence[int]) -> Entry:
        """The entry of a tensor not computed yet."""
        name = dtype_name(dtype)
        if name is None:
            raise ValueError(f"tensor {key!r}: dtype {dtype} cannot be stored in safetensors.")
        return cls(key, name, tuple(shape), math.prod(shape) * dtype.itemsize)

    @classmethod
    def of(cls, key: str, tensor: torch.Tensor) -> Entry:
        return cls.planned(key, tensor.dtype, tensor.shape)


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor of a file lies, from the file's header."""

    path: Path
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    offset: int  # where its bytes start in the file
    nbytes: int

    def entry(self, key: str) -> Entry:
        return Entry(key, self.dtype, self.shape, self.nbytes)


def _open(path: Path):
    """The safetensors library's reader of ``path``, once :func:`read_header` has validated it."""
    from safetensors import safe_open

    read_header(path)
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for a header it refuses
        raise _unreadable(path, str(e)) from None


def _unreadable(path: Path, why: str) -> FindingError:
    return FindingError(
        Finding(f"{path} is not a readable safetensors file ({why})", "re-copy or re-export it")
    )


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_problem(e: object) -> str | None:
    """Why one header entry is not ``{dtype, shape, data_offsets}`` the library reads, or None."""
    if not isinstance(e, dict):
        return "not an object"
    if e.get("dtype") not in DTYPES:
        return f"unknown dtype {e.get('dtype')!r}"
    shape, offsets = e.get("shape"), e.get("data_offsets")
    if not isinstance(shape, list) or not all(map(_is_size, shape)):
        return f"shape {shape!r} is not a list of sizes"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_size, offsets)):
        return f"data_offsets {offsets!r} are not two offsets"
    if (offsets[1] - offsets[0]) * 8 != math.prod(shape) * DTYPES[e["dtype"]][0]:
        return f"data_offsets {offsets} do not span its {e['dtype']} shape {shape}"
    return None


def read_header(path: str | Path) -> dict[str, StoredTensor]:
    """``{key: StoredTensor}`` of a file in header order, validated as the safetensors library does
    (standard library only); ``ValueError`` naming a truncated or corrupt file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _unreadable(path, "header too small")
            length = int.from_bytes(prefix, "little")
            if length > _MAX_HEADER_BYTES:
                raise _unreadable(path, "header too large")
            if 8 + length > size:
                raise _unreadable(path, "invalid header length")
            raw = f.read(length)
    except OSError as e:
        raise FindingError(os_error_finding(e)) from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _unreadable(path, f"invalid UTF-8 in header: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise _unreadable(path, f"invalid JSON in header: {e}") from None
    if not isinstance(header, dict):
        raise _unreadable(path, f"the header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _unreadable(path, "__metadata__ is not an object of strings")
    for key, e in header.items():
        if (problem := _entry_problem(e)) is not None:
            raise _unreadable(path, f"tensor {key!r}: {problem}")
    end = 0  # the tensors must tile the data, in offset order, with no gap or overlap
    for key, e in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        if e["data_offsets"][0] != end:
            raise _unreadable(path, f"invalid offset for tensor {key!r}")
        end = e["data_offsets"][1]
    if 8 + length + end != size:
        raise _unreadable(path, "incomplete metadata, file not fully covered")
    return {
        key: StoredTensor(
            path,
            e["dtype"],
            tuple(e["shape"]),
            8 + length + e["data_offsets"][0],
            e["data_offsets"][1] - e["data_offsets"][0],
        )
        for key, e in header.items()
    }


class TensorReader:
    """Reads tensors by key, keeping each file open (memory-mapped) until :meth:`close`."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._files: dict[Path, object] = {}

    def read(self, path: str | Path, key: str) -> torch.Tensor:
        path = Path(path)
        if path not in self._files:
            self._files[path] = self._stack.enter_context(_open(path))
        return self._files[path].get_tensor(key)

    def close(self) -> None:
        self._stack.close()
        self._files.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_tensor(path: str | Path, key: str) -> torch.Tensor:
    """One tensor of one file."""
    with TensorReader() as reader:
        return reader.read(path, key)


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one file, in header order."""
    with TensorReader() as reader:
        return {key: reader.read(path, key) for key in read_header(path)}


def read_rows(
    source: StoredTensor, rows: slice, buffer: torch.Tensor | None = None, fd: int | None = None
) -> torch.Tensor:
    """Rows ``rows`` (of the first dimension) of a stored tensor, read with ``pread`` from ``fd``
    (its file, opened by the caller so readahead follows a stream of chunks; else opened here),
    into the front of ``buffer`` (uint8) when given. No memory map, so the pages read never count
    towards this process's resident memory."""
    import torch

    n = source.shape[0] if source.shape else 1
    row_bytes = source.nbytes // max(n, 1)
    nbytes = row_bytes * (rows.stop - rows.start)
    if buffer is None or buffer.numel() < nbytes:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
    out = buffer[:nbytes]
    own = fd is None
    fd = os.open(source.path, os.O_RDONLY) if own else fd
    try:
        _pread_into(
            memoryview(out.numpy()), fd, source.offset + rows.start * row_bytes, source.path
        )
    finally:
        if own:
            os.close(fd)
    return out.view(torch_dtype(source.dtype)).view(rows.stop - rows.start, *source.shape[1:])


def read_bytes(source: StoredTensor) -> bytearray:
    """A stored tensor's bytes as its file holds them (little-endian), read without torch."""
    data = bytearray(source.nbytes)
    fd = os.open(source.path, os.O_RDONLY)
    try:
        _pread_into(memoryview(data), fd, source.offset, source.path)
    finally:
        os.close(fd)
    return data


def _pread_into(view: memoryview, fd: int, offset: int, path: Path) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a file that ends first is an ``OSError``."""
    while view:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise OSError(f"{path} ended inside a tensor at byte {offset}")
        view, offset = view[got:], offset + got


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    import torch

    return memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def pwrite_all(fd: int, tensor: torch.Tensor, offset: int) -> None:
    """Write ``tensor``'s bytes at ``offset`` of the open file ``fd``."""
    data = _bytes_of(tensor)
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def library_order(entries: Iterable[Entry]) -> list[Entry]:
    """``entries`` in the order the safetensors library's writer lays tensors out: by dtype, widest
    first in its ``Dtype`` order, then by name (byte order; for one dtype, simply sorted by key)."""
    return sorted(entries, key=lambda e: (-_LIBRARY_DTYPE_RANK[e.dtype], e.key.encode()))


@dataclass(frozen=True)
class FilePlan:
    """A file's layout, known before any data: the padded header JSON, each tensor's data offset."""

    header: bytes  # the JSON after the 8-byte length, space-padded to a multiple of 8
    offsets: dict[str, int]  # each key's first byte, counted from the end of the header
    data_bytes: int

    @property
    def data_start(self) -> int:
        return 8 + len(self.header)

    @property
    def size(self) -> int:
        """The whole file's size in bytes."""
        return self.data_start + self.data_bytes


def plan_file(
    entries: Sequence[Entry], metadata: Mapping[str, str] | None = DEFAULT_METADATA
) -> FilePlan:
    """The layout of a file of ``entries`` in this order, with ``metadata`` (``None``: no
    ``__metadata__``), serialized as the safetensors library does: compact JSON, non-ASCII kept."""
    header: dict[str, object] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offsets: dict[str, int] = {}
    offset = 0
    for e in entries:
        if e.key in offsets or e.key == "__metadata__":
            raise ValueError(f"tensor key {e.key!r} is planned twice or is reserved.")
        header[e.key] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offsets[e.key] = offset
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)  # the format allows space padding; aligned data reads faster
    return FilePlan(raw, offsets, offset)


def _write_all(file, data: memoryview) -> None:
    while data:  # an unbuffered write may be partial (Linux caps one at 2 GiB)
        data = data[file.write(data) :]


class SafetensorsWriter:
    """Writes one file whose tensors are all planned up front: the header first, then each tensor in order.

    The layout is :func:`plan_file`'s for ``entries`` in the order given (pass them through
    :func:`library_order` for the library's own layout) and ``metadata``. The file is built beside
    ``path`` and renamed into place by :meth:`close`; :meth:`abort`, or an exception inside
    ``with``, removes it.
    """

    def __init__(
        self,
        path: str | Path,
        entries: Sequence[Entry],
        *,
        metadata: Mapping[str, str] | None = DEFAULT_METADATA,
    ) -> None:
        self.path = Path(path)
        self.plan = plan_file(entries, metadata)
        raw = self.plan.header
        self._data_start = self.plan.data_start
        self._offsets = self.plan.offsets
        # Imported by writers only: vLLM's workers, which only read, never load signal handling.
        from vllm_dspark.safety import staged

        self._staging = staged(self.path, directory=False)
        staging = self._staging.__enter__()
        self._file = open(staging, "wb", buffering=0)  # noqa: SIM115 - closed in close() / abort()
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._pending = deque(entries)
        self._written: set[str] = set()

    def _next(self, key: str) -> Entry:
        if not self._pending or self._pending[0].key != key:
            if key in self._written:
                raise ValueError(f"tensor {key!r} written twice to {self.path}.")
            planned = self._pending[0].key if self._pending else "nothing more"
            raise ValueError(
                f"tensor {key!r} written to {self.path} where its header plans {planned}."
            )
        self._written.add(key)
        return self._pending.popleft()

    def write(self, key: str, tensor: torch.Tensor) -> None:
        entry = self._next(key)
        got = (dtype_name(tensor.dtype), tuple(tensor.shape))
        if got != (entry.dtype, entry.shape):
            raise ValueError(
                f"tensor {key!r} is {got}, but {self.path}'s header plans {(entry.dtype, entry.shape)}."
            )
        _write_all(self._file, _bytes_of(tensor))

    def copy(self, key: str, source: StoredTensor) -> None:
        """Copy a tensor's bytes from another file: bit-identical by construction."""
        self._next(key)
        offset, remaining = source.offset, source.nbytes
        with open(source.path, "rb", buffering=0) as src:
            while remaining:
                try:  # in-kernel copy, no round trip through this process's memory
                    n = os.copy_file_range(src.fileno(), self._file.fileno(), remaining, offset)
                except (
                    AttributeError,
                    OSError,
                ):  # not Linux, or a filesystem pair it does not support
                    chunk = os.pread(src.fileno(), min(remaining, 64 << 20), offset)
                    _write_all(self._file, memoryview(chunk))
                    n = len(chunk)
                if n == 0:
                    raise OSError(f"{source.path} ended inside tensor {key}")
                offset += n
                remaining -= n

    def claim_rest(self) -> dict[str, int]:
        """Claim every tensor not written yet for positional writes (``os.pwrite`` on :meth:`fileno`),
        from any thread and in any order: ``{key: its file offset}``. Every byte must be written."""
        claimed = {e.key: self._data_start + self._offsets[e.key] for e in self._pending}
        self._written.update(claimed)
        self._pending.clear()
        return claimed

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        if self._pending:
            self.abort()
            raise ValueError(
                f"{self.path}: {len(self._pending)} planned tensors were never written."
            )
        self._file.close()
        self._staging.__exit__(None, None, None)

    def abort(self) -> None:
        self._file.close()
        error = RuntimeError(f"{self.path}: write aborted")
        self._staging.__exit__(RuntimeError, error, None)  # staged removes the partial file

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_tensors(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = DEFAULT_METADATA,
    in_library_order: bool = False,
) -> None:
    """Write in-memory ``tensors`` to one file: in their order, or with ``in_library_order`` as the
    safetensors library's ``save_file(tensors, path, metadata)`` would, byte for byte."""
    entries = [Entry.of(k, t) for k, t in tensors.items()]
    if in_library_order:
        entries = library_order(entries)
    with SafetensorsWriter(path, entries, metadata=metadata) as writer:
        for entry in entries:
            writer.write(entry.key, tensors[entry.key])
