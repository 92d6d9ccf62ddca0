"""Tests of lrmoe/demo/data.py: the stdlib corpus split and the seeded batch sampler."""

from __future__ import annotations

import torch

from lrmoe.demo.data import (
    heldout_batches,
    load_prose_corpus,
    load_stdlib_corpus,
    load_text_corpus,
    sample_batch,
    stdlib_source_files,
)


def test_stdlib_files_are_sorted_sources_without_tests_or_site_packages():
    files = stdlib_source_files()
    assert len(files) > 100
    parts = {part for path in files for part in path.parts}
    assert not {"site-packages", "test", "tests", "__pycache__"} & parts
    assert all(path.suffix == ".py" for path in files)


def test_stdlib_corpus_is_capped_and_deterministic():
    first, second = load_stdlib_corpus(300_000), load_stdlib_corpus(300_000)
    total = first.train_N.numel() + first.heldout_N.numel()
    assert 300_000 <= total < 300_000 + max(p.stat().st_size for p in stdlib_source_files())
    assert first.heldout_N.numel() > 0 and first.train_N.numel() > 4 * first.heldout_N.numel()
    assert torch.equal(first.train_N, second.train_N) and torch.equal(first.heldout_N, second.heldout_N)


def test_text_corpus_splits_by_position(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(256)) * 40)
    corpus = load_text_corpus(path)
    assert corpus.train_N.numel() == 9216 and corpus.heldout_N.numel() == 1024
    assert torch.equal(torch.cat([corpus.train_N, corpus.heldout_N]), torch.tensor(list(bytes(range(256)) * 40)))


def test_sample_batch_windows_follow_the_generator():
    data_N = torch.arange(1000, dtype=torch.int64).remainder(256).to(torch.uint8)
    a = sample_batch(data_N, 4, 16, torch.Generator().manual_seed(7))
    b = sample_batch(data_N, 4, 16, torch.Generator().manual_seed(7))
    c = sample_batch(data_N, 4, 16, torch.Generator().manual_seed(8))
    assert a.shape == (4, 17) and a.dtype == torch.int64
    assert torch.equal(a, b) and not torch.equal(a, c)
    # Each row is a contiguous window of the data.
    assert torch.equal((a[:, 1:] - a[:, :-1]).remainder(256), torch.ones(4, 16, dtype=torch.int64))


def test_heldout_batches_are_fixed_and_cover_the_split():
    data_N = torch.randint(256, (5000,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    batches = heldout_batches(data_N, 4, 32, 3)
    assert len(batches) == 3 and all(b.shape == (4, 33) for b in batches)
    assert torch.equal(batches[0][0], data_N[:33].long())
    assert torch.equal(batches[-1][-1], data_N[-33:].long())


def test_prose_corpus_holds_out_docstrings_even_when_the_topics_alone_fill_the_cap(monkeypatch):
    # Python 3.12's pydoc topics alone pass the quick preset's 500 kB: the topics then filled the whole budget,
    # nothing was held out, and the demo failed building an empty tensor (seen on the GPU machine).
    import pydoc_data.topics

    big = {f"topic{i:02d}": ("word " * 20_000) for i in range(10)}  # 10 x 100 kB
    monkeypatch.setattr(pydoc_data.topics, "topics", big)
    corpus = load_prose_corpus(500_000)
    assert corpus.heldout_N.numel() > 0
    # Topics up to half the cap train (two of 100 kB fit under 250 kB, a third would not); docstrings the rest.
    assert bytes(corpus.train_N.tolist()).count(b"word " * 20_000) == 2
