"""Byte-level text data for the demo: a corpus split into train and held-out bytes, and a seeded batch sampler.

Shapes: N bytes of a split, B batch, L sequence length. Tokens are raw bytes (vocab 256), so no tokenizer is
needed and any text file works.

The built-in corpus is the Python standard library's own ``.py`` sources, found from the running interpreter.
It is split by file (sorted file list, every 10th file held out), so held-out text comes from modules the model
never trained on, and the split is the same for every run on the same interpreter.
"""

from __future__ import annotations

import ast
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "VOCAB_SIZE",
    "Corpus",
    "stdlib_source_files",
    "load_stdlib_corpus",
    "load_text_corpus",
    "load_prose_corpus",
    "CORPORA",
    "load_corpus",
    "sample_batch",
    "heldout_batches",
]

VOCAB_SIZE = 256
"""Byte-level tokens."""

# pydoc_data holds the documentation's English prose, which is the separate "prose" corpus.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "pydoc_data"})
_HELDOUT_EVERY = 10


@dataclass(frozen=True)
class Corpus:
    """Train and held-out bytes as uint8 tensors, plus a one-line description of where they came from."""

    train_N: torch.Tensor
    heldout_N: torch.Tensor
    source: str

    def describe(self) -> str:
        return f"{self.source}: {self.train_N.numel():,} train bytes, {self.heldout_N.numel():,} held-out bytes"


def stdlib_source_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted by path relative to the stdlib root.

    Skips third-party packages (site-packages), test directories and caches.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_utf8(path: Path) -> bytes | None:
    """The file's bytes if it is readable UTF-8 text, else None."""
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return data


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _split_stdlib(extract, max_bytes: int) -> tuple[list, list]:
    """Items ``extract(file bytes)`` of the stdlib sources in sorted file order, as (train, held-out) lists: the
    items of every 10th file are held out. Stops once about ``max_bytes`` (by item length) have been taken; the
    file index, and so the split, is the same whatever is extracted."""
    train, heldout, total = [], [], 0
    for index, path in enumerate(stdlib_source_files()):
        if total >= max_bytes:
            break
        data = _read_utf8(path)
        if data is None:
            continue
        items = extract(data)
        (heldout if index % _HELDOUT_EVERY == _HELDOUT_EVERY - 1 else train).extend(items)
        total += sum(len(item) for item in items)
    return train, heldout


def load_stdlib_corpus(max_bytes: int = 4_000_000) -> Corpus:
    """Stdlib sources, every 10th file (of the sorted list) held out, reading at most about ``max_bytes``.

    Files are read in sorted order until the cap is reached, so the corpus only depends on the interpreter and
    the cap, and startup stays fast.
    """
    train_parts, heldout_parts = _split_stdlib(lambda data: [data], max_bytes)
    if not train_parts or not heldout_parts:
        raise RuntimeError(f"found too little Python source under {sysconfig.get_paths()['stdlib']}")
    return Corpus(
        train_N=_to_tensor(b"".join(train_parts)),
        heldout_N=_to_tensor(b"".join(heldout_parts)),
        source="python stdlib sources",
    )


def load_text_corpus(path: str | os.PathLike, max_bytes: int | None = None, heldout_fraction: float = 0.1) -> Corpus:
    """A user text file (any bytes), split by position: the first 90% train, the last 10% held out."""
    data = Path(path).read_bytes()
    if max_bytes is not None:
        data = data[:max_bytes]
    split = int(len(data) * (1.0 - heldout_fraction))
    return Corpus(train_N=_to_tensor(data[:split]), heldout_N=_to_tensor(data[split:]), source=str(path))


def _docstrings(data: bytes) -> list[str]:
    """Module, class and function docstrings of one Python source file (none if it does not parse)."""
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [doc for node in ast.walk(tree) if isinstance(node, kinds) and (doc := ast.get_docstring(node))]


def load_prose_corpus(max_bytes: int = 4_000_000) -> Corpus:
    """English prose shipped with the interpreter, a different distribution from the Python sources.

    Train: the language reference topics of ``pydoc_data`` (~0.5 MB) and the docstrings of the stdlib files the
    Python corpus trains on; held-out: the docstrings of the files it holds out (every 10th), so a model
    pretrained on the Python corpus has never seen the held-out prose, even as code. About 2 MB in all, enough
    for a few hundred continued-training steps without repeating the data many times over.
    """
    from pydoc_data.topics import topics

    # The topics take at most half of max_bytes (in sorted order), so the docstrings, and with them the held-out
    # part, always get the other half: Python 3.12's topics alone pass the quick preset's 500 kB.
    train_parts, size = [], 0
    for name in sorted(topics):
        if size + len(topics[name]) > max_bytes // 2:
            break
        train_parts.append(topics[name])
        size += len(topics[name])
    train_docs, heldout_parts = _split_stdlib(_docstrings, max_bytes - size)
    train_parts += train_docs
    if not train_parts or not heldout_parts:
        raise RuntimeError(f"found too little prose for a held-out split in {max_bytes} bytes (pydoc topics and "
                           f"stdlib docstrings under {sysconfig.get_paths()['stdlib']})")
    return Corpus(
        train_N=_to_tensor("\n\n".join(train_parts).encode("utf-8")),
        heldout_N=_to_tensor("\n\n".join(heldout_parts).encode("utf-8")),
        source="python documentation prose (pydoc topics and stdlib docstrings)",
    )


CORPORA = {"python": load_stdlib_corpus, "prose": load_prose_corpus}
"""Built-in corpora by name."""


def load_corpus(name_or_path: str | os.PathLike | None = None, max_bytes: int = 4_000_000) -> Corpus:
    """A built-in corpus by name ("python", the default, or "prose"), else the user text file at that path."""
    if name_or_path is None or str(name_or_path) in CORPORA:
        return CORPORA[str(name_or_path or "python")](max_bytes)
    return load_text_corpus(name_or_path, max_bytes)


def _windows(data_N: torch.Tensor, starts_B: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, L+1] int64 windows of ``data_N`` beginning at ``starts_B``."""
    offsets_L = torch.arange(seq_len + 1)
    return data_N[starts_B[:, None] + offsets_L[None, :]].long()


def _check_length(data_N: torch.Tensor, seq_len: int) -> int:
    n_starts = data_N.numel() - seq_len
    if n_starts < 1:
        raise ValueError(f"need more than seq_len + 1 = {seq_len + 1} bytes, got {data_N.numel()}")
    return n_starts


def sample_batch(data_N: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """[B, L+1] int64 windows at uniformly random offsets drawn from ``generator``.

    Inputs are ``batch[:, :-1]`` and targets ``batch[:, 1:]``. Two runs whose generators start from the same
    seed see the same batches in the same order.
    """
    n_starts = _check_length(data_N, seq_len)
    starts_B = torch.randint(n_starts, (batch_size,), generator=generator)
    return _windows(data_N, starts_B, seq_len)


def heldout_batches(data_N: torch.Tensor, batch_size: int, seq_len: int, num_batches: int) -> list[torch.Tensor]:
    """``num_batches`` fixed [B, L+1] int64 batches of windows spaced evenly over ``data_N``.

    No randomness: every run evaluates on exactly the same bytes.
    """
    n_starts = _check_length(data_N, seq_len)
    n_windows = batch_size * num_batches
    starts_W = torch.linspace(0, n_starts - 1, n_windows).long()
    return [_windows(data_N, starts_B, seq_len) for starts_B in starts_W.split(batch_size)]
