"""Tokenizer: bundled BPE round trips, special ids match the configs, Kimi layout from a checkpoint dir."""

import base64
import json
from pathlib import Path

import pytest

from k3_jax.config import load_config
from k3_jax.tokenizer import (
    KIMI_NUM_RESERVED_SPECIAL,
    Tokenizer,
    TokenizerError,
    read_rank_file,
    write_rank_file,
)
from k3_jax.training.bpe import train_bpe

TEXTS = [
    "The \"if\" statement is used for conditional execution.",
    "  leading spaces, tabs\t and\nnewlines\n\n",
    "Unicode: naïve café — 中文English混合 🙂",
    "don't CAPS 1234567 x=foo(bar)",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.bundled()


@pytest.mark.parametrize("text", TEXTS)
def test_bundled_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_bundled_ids_match_configs(tok):
    for name in ("k3-tiny", "k3-small"):
        cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / f"{name}.json")
        assert tok.vocab_size <= cfg.vocab_size
        assert (tok.bos_id, tok.eos_id, tok.pad_id) == (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    assert tok.vocab_size == 1024


def test_bundled_compresses_english(tok):
    text = "The for statement is used to iterate over the elements of a sequence."
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_special_tokens_text_vs_allowed(tok):
    ids = tok.encode("[BOS]x", add_bos=True, add_eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1  # "[BOS]" in text stays text
    assert tok.encode("[EOS]", allow_special=True) == [2]
    assert tok.decode(ids, skip_special=True) == "[BOS]x"


def test_rank_file_round_trip_and_errors(tmp_path):
    ranks = {b"a": 0, b"\x00\xff": 1, b" the": 2}
    write_rank_file(tmp_path / "r.tiktoken", ranks)
    assert read_rank_file(tmp_path / "r.tiktoken") == ranks
    (tmp_path / "bad.tiktoken").write_text("YQ== 0 extra\n")
    with pytest.raises(TokenizerError, match="bad.tiktoken:1"):
        read_rank_file(tmp_path / "bad.tiktoken")
    with pytest.raises(TokenizerError, match="not found"):
        read_rank_file(tmp_path / "missing")


def test_train_bpe_learns_frequent_merges():
    ranks = train_bpe(["hello hello hello world"] * 5, vocab_size=256 + 6)
    assert len(ranks) == 262 and sorted(ranks.values()) == list(range(262))
    assert b"hello" in ranks or b" hello" in ranks


def test_kimi_layout_from_checkpoint_dir(tmp_path):
    """A fake release dir: 300 ranks -> specials at 300..555, names + ids from the json files."""
    ranks = {bytes([b]): b for b in range(256)}
    for m in [b"th", b"he", b"the", b" the"] + [bytes([65, 65 + i]) for i in range(40)]:
        ranks.setdefault(m, len(ranks))
    n = len(ranks)
    (tmp_path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(n): {"content": "[BOS]"}, str(n + 1): {"content": "[EOS]"},
                                 str(n + 2): {"content": "<|im_end|>"}},
        "bos_token": "[BOS]", "eos_token": "<|im_end|>"}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.vocab_size == n + KIMI_NUM_RESERVED_SPECIAL
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (n, n + 2, None)
    assert tok.special_id(f"<|reserved_token_{n + 5}|>") == n + 5
    assert tok.encode("the the") == [ranks[b"the"], ranks[b" the"]]
    # config.json ids win over tokenizer_config names (K3: eos 163586, pad 163839)
    ids = {"bos_token_id": n, "eos_token_id": n + 1, "pad_token_id": n + 255}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": ids}))
    tok = Tokenizer.from_pretrained(tmp_path / "tiktoken.model")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (n, n + 1, n + 255)
    assert tok.decode(tok.encode("the x", add_bos=True)) == "[BOS]the x"
