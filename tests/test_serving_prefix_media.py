"""Prefix cache with images: media digests are part of the prefix identity (``Engine._media_spans``).

A micro multimodal model (one KDA + one MLA layer, the tiny vision tower) in one paged engine (pages of 16, hash
blocks of 4, snapshots every 8 tokens, prefill pieces of 8; 24-token prompts). Two requests sharing a text+image
prefix: the second hits the cache and gives the same greedy tokens and log-probs as its cold run (the engine with
the cache detached: same pieces, same compiled functions). The same token ids with a different image do not hit,
nor does a text-only entry serve a media request whose ``pad_token_id`` embeddings are zeroed.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from k3_jax.config import load_config
from k3_jax.convert.fixture import random_params, random_vision_params
from k3_jax.serving.engine import Engine
from k3_jax.serving.media import ZEROED_PAD_DIGEST, RequestMedia
from k3_jax.serving.prefix_cache import PrefixCacheConfig, block_hashes
from k3_jax.serving.sampling import SamplingParams
from k3_jax.vision.processor import MediaProcessor
from tests._model_fixtures import REPO

MICRO_TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "kda_layers": (0,), "mla_layers": (1,),
              "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
              "qk_rope_head_dim": 8, "v_head_dim": 16, "kda_num_heads": 2, "kda_head_dim": 16,
              "intermediate_size": 128, "num_experts": 0, "attn_res_block_size": 1}
PC = PrefixCacheConfig(page_size=16, block_size=4, stride=8, mla_budget_bytes=1 << 24, kda_budget_bytes=1 << 24)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup():
    base = load_config(REPO / "configs" / "k3-tiny-vision.json")
    cfg = base.replace(**MICRO_TEXT, dtype="float32",
                       vision=dataclasses.replace(base.vision, text_hidden_size=MICRO_TEXT["hidden_size"]))
    params = {**random_params(cfg, seed=1), **random_vision_params(cfg.vision, seed=1)}
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    engine = Engine(cfg, params, max_batch=2, max_len=64, prefill_chunk=8, prefill_mode="unit", paged=True,
                    eos_ids=(), prefix_cache=PC)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (56, 84, 3), dtype=np.uint8) for _ in range(2)]  # 84x56: 2x3 tokens each
    processed = [MediaProcessor()([im]) for im in images]
    return cfg, engine, processed


def _media(processed) -> RequestMedia:
    return RequestMedia.from_processed(processed)  # a fresh object: the engine encodes it itself


def _run(engine, ids, media, cold=False):
    """(greedy tokens, their log-probs, tokens restored from the cache) of one request run alone."""
    prefix = engine.prefix
    before = prefix.stats["cached_tokens"]
    if cold:
        engine.prefix = None
    try:
        rid = engine.add_request(ids, GREEDY, media=media)
        events = []
        while engine.has_work:
            events += [e for e in engine.step() if e.request_id == rid]
    finally:
        engine.prefix = prefix
    assert events[-1].finished and events[-1].error is None, events[-1].error
    return [e.token for e in events], [e.logprob for e in events], prefix.stats["cached_tokens"] - before


def test_image_prefix_hits_and_a_different_image_does_not(setup):
    cfg, engine, (img_a, img_b) = setup
    pad = cfg.media_placeholder_token_id
    n_img = img_a.num_tokens[0]
    assert n_img == 6 and img_b.grid_thws.tolist() == img_a.grid_thws.tolist()  # same token ids for both
    head = [1, 40, 41, 42, 43] + [pad] * n_img + [44, 45, 46, 47, 48]  # image at [5, 11), 16 tokens
    first = head + [50, 51, 52, 53, 54, 55, 56, 57]  # 24 tokens: prefill pieces of 8 only (one compile)
    second = head + [60, 61, 62, 63, 64, 65, 66, 67]

    out, _, cached = _run(engine, first, _media(img_a))  # fills the cache: entries at 8 and 16
    assert cached == 0 and len(out) == GREEDY.max_tokens
    cold_tokens, cold_logprobs, _ = _run(engine, second, _media(img_a), cold=True)
    hit_media = _media(img_a)
    tokens, logprobs, cached = _run(engine, second, hit_media)
    assert cached == 16  # the image and the text around it came from the cache
    assert hit_media.embeds is None  # every item was in the cached prefix: the tower did not run
    assert tokens == cold_tokens
    np.testing.assert_allclose(logprobs, cold_logprobs, rtol=1e-5, atol=1e-5)

    spans_a = engine._media_spans(_Req(second, _media(img_a)))
    spans_b = engine._media_spans(_Req(second, _media(img_b)))
    assert spans_a[0][:2] == spans_b[0][:2] == (5, 11) and spans_a[0][2] != spans_b[0][2]
    tokens_b, logprobs_b, cached = _run(engine, second, _media(img_b))  # same ids, another image
    assert cached == 0
    assert logprobs_b != logprobs  # the image reaches the output (so a wrong hit would show)


def test_zeroed_pad_token_is_part_of_the_identity(setup):
    """With media, ``pad_token_id`` positions are embedded as zeros (as in the release), so their blocks must not
    hash like the same ids of a text-only request (whose entry would otherwise serve the media request)."""
    cfg, engine, (img_a, _) = setup
    ids = [1, cfg.pad_token_id, 70, 71, 72, 73, 74, 75, *[cfg.media_placeholder_token_id] * 6, 80, 81]
    spans = engine._media_spans(_Req(ids, _media(img_a)))
    assert spans[0] == (1, 2, ZEROED_PAD_DIGEST) and spans[1][:2] == (8, 14)
    with_media, text_only = block_hashes(ids, PC.block_size, spans), block_hashes(ids, PC.block_size)
    assert with_media[0] != text_only[0]


@dataclasses.dataclass
class _Req:  # the two fields Engine._media_spans reads
    prompt: list[int]
    media: RequestMedia
