# SPDX-License-Identifier: Apache-2.0
"""Token streams for the drift harness: where anchors and the ``boot`` regime's tokens come from.

The default is the small public-domain text shipped in ``vllm_dspark/data/corpus.txt``, mapped to
ids byte by byte (offline, any vocabulary of at least 256 ids). A user file may hold token ids
(``.npy`` integers, ``.json`` list or list of lists, ``.txt`` separated ids) or text with
``--tokenizer DIR``. Documents are concatenated into one stream cut into ``context_len + 1`` windows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from vllm_dspark.findings import Finding, FindingError

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"


def byte_ids(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as token ids in ``[0, 256)``."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _ids_from_json(obj) -> np.ndarray:
    if (
        isinstance(obj, list)
        and obj
        and all(isinstance(doc, list) and all(map(_is_id, doc)) for doc in obj)
    ):
        return np.concatenate([np.asarray(doc, dtype=np.int64) for doc in obj])
    if isinstance(obj, list) and all(map(_is_id, obj)):
        return np.asarray(obj, dtype=np.int64)
    raise ValueError(
        "a .json corpus must be a list of integer token ids or a list of lists of them "
        "(a float would be truncated to a different id)"
    )


def _ids_from_npy(path: Path) -> np.ndarray:
    try:
        ids = np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as e:
        raise FindingError(
            Finding(f"{path} is not a .npy array file ({e})", "save the token ids with numpy.save")
        ) from None
    if not np.issubdtype(ids.dtype, np.integer):
        raise FindingError(
            Finding(
                f"{path} holds {ids.dtype} values, not integer token ids (a float would be truncated to a "
                "different id)",
                "save the token ids as an integer array, e.g. np.int64",
            )
        )
    return ids.astype(np.int64).ravel()


def _ids_from_txt(text: str, path: Path) -> np.ndarray:
    fields = [f for f in re.split(r"[\s,]+", text.strip()) if f]
    if not fields or not all(re.fullmatch(r"\d+", f) for f in fields):
        raise ValueError(
            f"{path}: a .txt corpus without --tokenizer must hold token ids separated by whitespace or commas; "
            "to use plain text, pass --tokenizer DIR (a Hugging Face tokenizer directory)"
        )
    return np.asarray([int(f) for f in fields], dtype=np.int64)


_CORPUS_FORMATS = "pass .npy / .json / .txt token ids, or a UTF-8 text file with --tokenizer DIR"


def _read_text(path: Path, what: str) -> str:
    """``path`` as UTF-8 text; a ``FindingError`` naming it and the formats if it is not."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise FindingError(
            Finding(
                f"--corpus {path} is not UTF-8 text (byte {e.start}: {e.reason}); {what}",
                _CORPUS_FORMATS,
            )
        ) from None


def load_corpus(
    path: str | Path | None = None, *, tokenizer: str | Path | None = None, vocab_size: int
) -> tuple[np.ndarray, str]:
    """The token stream and a one-line description of where it came from.

    Raises ``ValueError`` if an id falls outside ``[0, vocab_size)``.
    """
    if path is None:
        if tokenizer is not None:
            raise ValueError("--tokenizer needs --corpus: a text file to tokenize")
        ids = byte_ids(DEFAULT_CORPUS.read_text(encoding="utf-8"))
        source = f"default corpus {DEFAULT_CORPUS.name} ({len(ids)} UTF-8 bytes as ids)"
    else:
        path = Path(path)
        if not path.is_file():
            raise FindingError(
                Finding(
                    f"--corpus {path} {'is a directory' if path.is_dir() else 'does not exist'}",
                    _CORPUS_FORMATS,
                )
            )
        if tokenizer is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(tokenizer))
            ids = np.asarray(
                tok.encode(
                    _read_text(path, "with --tokenizer it must be text"), add_special_tokens=False
                ),
                dtype=np.int64,
            )
            source = f"{path} tokenized with {tokenizer}"
        elif path.suffix == ".npy":
            ids = _ids_from_npy(path)
            source = str(path)
        elif path.suffix == ".json":
            try:
                raw = json.loads(_read_text(path, "a .json corpus is a list of token ids"))
            except json.JSONDecodeError as e:
                raise FindingError(
                    Finding(f"--corpus {path} is not valid JSON ({e})", _CORPUS_FORMATS)
                ) from None
            ids = _ids_from_json(raw)
            source = str(path)
        elif path.suffix == ".txt":
            ids = _ids_from_txt(_read_text(path, "a .txt corpus is token ids as text"), path)
            source = str(path)
        else:
            raise ValueError(
                f"{path}: unsupported corpus file; use .npy, .json or .txt token ids, "
                "or a text file with --tokenizer DIR"
            )
    if ids.size == 0:
        raise ValueError(f"the corpus ({source}) is empty")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise ValueError(
            f"the corpus ({source}) holds ids outside the drafter's vocabulary [0, {vocab_size}), "
            f"e.g. {int(ids[bad][0])}; tokenize with the target's tokenizer"
        )
    return ids, source


def window_starts(stream_len: int, window: int, num_blocks: int, seed: int) -> np.ndarray:
    """``[num_blocks]`` start offsets of windows of ``window`` tokens, drawn with a fixed seed.

    Distinct offsets while the stream has enough of them; beyond that (more blocks than offsets)
    offsets repeat, and in the ``boot`` regime repeated blocks narrow the bootstrap interval
    artificially, so give a longer ``--corpus`` for large ``--blocks``.
    """
    if stream_len < window:
        raise ValueError(
            f"the corpus has {stream_len} tokens; a block needs {window} (context_len + 1)"
        )
    choices = stream_len - window + 1
    rng = np.random.default_rng([seed, 0xC0])
    return rng.choice(choices, size=num_blocks, replace=num_blocks > choices).astype(np.int64)
