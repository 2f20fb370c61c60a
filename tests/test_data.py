"""Data pipeline: packing with segment ids, determinism, exact resume from the iterator state."""

import json

import numpy as np
import pytest

from k3_jax.training.corpus import load_token_shard, save_token_shard
from k3_jax.training.data import DataConfig, DataIterator, TokenDocuments, loss_mask, make_dataset


@pytest.fixture()
def shard(tmp_path):
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 40, size=60)
    docs = [np.full(n, 10 + i, np.uint16) for i, n in enumerate(lens)]  # doc i is all token 10+i
    tokens = np.concatenate(docs)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    path = tmp_path / "s.npz"
    save_token_shard(path, tokens, offsets)
    return path, docs


def test_bundled_shard_is_valid():
    tokens, offsets = load_token_shard()
    assert tokens.dtype == np.uint16 and len(offsets) > 1000 and int(tokens.max()) < 1024


def test_packing_segments_and_bos_eos(shard):
    path, docs = shard
    cfg = DataConfig(paths=(str(path),), seq_len=31, batch_size=4, seed=1)
    it = DataIterator(make_dataset(cfg))
    for _ in range(5):
        b = next(it)
        tok, seg = b["tokens"], b["segment_ids"]
        assert tok.shape == seg.shape == (4, 32) and tok.dtype == np.int32
        assert np.all(seg >= 1)  # always full rows
        for r in range(4):
            for s in np.unique(seg[r]):
                piece = tok[r][seg[r] == s]
                content = piece[(piece != 1) & (piece != 2)]
                assert len(np.unique(content)) <= 1  # one document per segment
                assert np.all(np.diff(np.nonzero(seg[r] == s)[0]) == 1)  # contiguous
        m = loss_mask(seg)
        assert m.shape == (4, 31)
        # the loss never asks to predict across a boundary
        assert not np.any(m & (seg[:, 1:] != seg[:, :-1]))


def test_deterministic_and_resumable(shard):
    path, _ = shard
    cfg = DataConfig(paths=(str(path),), seq_len=15, batch_size=2, seed=3)
    a = DataIterator(make_dataset(cfg))
    ref = [next(a)["tokens"] for _ in range(12)]
    b = DataIterator(make_dataset(cfg))
    for i in range(5):
        np.testing.assert_array_equal(next(b)["tokens"], ref[i])
    state = json.loads(json.dumps(b.get_state()))
    c = DataIterator(make_dataset(cfg))
    c.set_state(state)
    for i in range(5, 12):  # goes through an epoch boundary (60 docs ~ 1200 tokens, 12*32 rows)
        np.testing.assert_array_equal(next(c)["tokens"], ref[i])
    other = DataIterator(make_dataset(DataConfig(paths=(str(path),), seq_len=15, batch_size=2, seed=4)))
    assert not np.array_equal(next(other)["tokens"], ref[0])


def test_process_split_of_rows_is_the_single_process_batch(shard):
    """Each global row is its own stream: 2 processes (contiguous rows, or any row split) together read
    exactly the single-process batches, and the merged per-row state resumes under another process count."""
    from k3_jax.training.data import merge_row_states

    path, _ = shard
    cfg = DataConfig(paths=(str(path),), seq_len=31, batch_size=4, seed=2)
    one = DataIterator(make_dataset(cfg))
    ref = [next(one)["tokens"] for _ in range(6)]
    halves = [DataIterator(make_dataset(cfg, process_index=p, process_count=2)) for p in range(2)]
    assert [h.rows for h in halves] == [(0, 1), (2, 3)]
    for i in range(3):
        np.testing.assert_array_equal(np.concatenate([next(h)["tokens"] for h in halves]), ref[i])
    odd = DataIterator(make_dataset(cfg, rows=(1, 3)))
    for _ in range(3):
        next(odd)
    merged = merge_row_states([h.get_state() for h in halves])
    np.testing.assert_array_equal(next(odd)["tokens"], ref[3][[1, 3]])
    whole = DataIterator(make_dataset(cfg))
    whole.set_state(merged)  # saved by 2 processes, resumed by 1
    for i in range(3, 6):
        np.testing.assert_array_equal(next(whole)["tokens"], ref[i])
    docs_of_row = [set(np.unique(np.stack(ref)[:, r])) - {1, 2} for r in range(4)]  # one token per document
    assert all(not (docs_of_row[a] & docs_of_row[b]) for a in range(4) for b in range(a))  # disjoint documents
    with pytest.raises(ValueError, match="lacks rows"):
        DataIterator(make_dataset(DataConfig(paths=(str(path),), seq_len=31, batch_size=8))).set_state(merged)


def test_documents_across_shards(shard, tmp_path):
    path, docs = shard
    docs2 = TokenDocuments([path, path])
    assert len(docs2) == 120
    np.testing.assert_array_equal(docs2[61], docs[1])


def test_tokenize_entry_point_round_trip(tmp_path):
    from k3_jax.tokenizer import Tokenizer
    from k3_jax.training.tokenize import main

    (tmp_path / "a.txt").write_text("First paragraph here.\n\nSecond one, longer than the first.\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "a json document"}) + "\n\n")
    out = tmp_path / "s.npz"
    assert main([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--field", "body",
                 "--split-paragraphs", "--out", str(out)]) == 0
    tokens, offsets = load_token_shard(out)
    tok = Tokenizer.bundled()
    docs = [tok.decode(tokens[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)]
    assert docs == ["First paragraph here.", "Second one, longer than the first.", "a json document"]
    with pytest.raises(KeyError, match="no field"):
        main([str(tmp_path / "b.jsonl"), "--out", str(out)])
