"""Images through the engine and the OpenAI server, on the tiny multimodal config (``configs/k3-tiny-vision.json``,
its text model cut to one MLA layer so the compiles stay cheap): a prompt with an image gives the greedy tokens and
logprobs of :class:`K3ForConditionalGeneration` on the whole sequence; an inline-PNG chat request answers; bad
images answer 400 naming the part and the next normal request still works."""

from __future__ import annotations

import base64
import dataclasses
import functools
import io

import jax
import numpy as np
import pytest
from PIL import Image

from k3_jax.config import load_config
from k3_jax.convert.fixture import random_params, random_vision_params
from k3_jax.model import K3ForConditionalGeneration
from k3_jax.serving.engine import Engine, RequestError
from k3_jax.serving.media import MediaServingConfig, RequestMedia, chat_request_ids, chunk_media, media_digest
from k3_jax.serving.sampling import SamplingParams
from k3_jax.tokenizer import Tokenizer
from k3_jax.vision.processor import ImageError, MediaProcConfig
from tests._model_fixtures import REPO
from tests.serving_common import running_server

MICRO_TEXT = {"hidden_size": 64, "num_hidden_layers": 1, "kda_layers": (), "mla_layers": (0,),
              "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
              "qk_rope_head_dim": 8, "v_head_dim": 16, "intermediate_size": 128, "num_experts": 0,
              "attn_res_block_size": 1}
MAX_LEN = 96
PROC = MediaProcConfig(max_image_pixels=200 * 200)  # small guard, so the "too many pixels" case is cheap


def _png(size: tuple[int, int], colour: tuple[int, int, int]) -> str:
    buf = io.BytesIO()
    img = Image.new("RGB", size, colour)
    img.paste((255 - colour[0], 40, 200), (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@functools.cache
def _setup():
    base = load_config(REPO / "configs" / "k3-tiny-vision.json")
    cfg = base.replace(**MICRO_TEXT, dtype="float32",
                       vision=dataclasses.replace(base.vision, text_hidden_size=MICRO_TEXT["hidden_size"]))
    params = {**random_params(cfg, seed=0), **random_vision_params(cfg.vision, seed=0)}
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    tok = Tokenizer.bundled(media=True)
    engine = Engine(cfg, params, max_batch=2, max_len=MAX_LEN, prefill_chunk=16, prefill_mode="unit", tokenizer=tok,
                    eos_ids=(cfg.eos_token_id,))
    return cfg, {"params": params}, tok, engine


def _image_chat(url: str, text: str = "what is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_engine_with_image_matches_the_whole_sequence_model():
    cfg, variables, tok, engine = _setup()
    ids, media = chat_request_ids(tok, _image_chat(_png((60, 44), (200, 30, 10))), cfg,
                                  MediaServingConfig(proc=PROC))
    assert media.num_tokens == (6,) and ids.count(cfg.media_placeholder_token_id) == 6  # 84x56 px: 3x2 tokens
    assert media.digests[0] == media_digest(media.pixel_values, media.grid_thws[0])
    n_new = 5
    rid = engine.add_request(ids, SamplingParams(max_tokens=n_new, temperature=0.0, logprobs=0, ignore_eos=True),
                             media=media)
    events = []
    while engine.has_work:
        events += [e for e in engine.step() if e.request_id == rid]
    out = [e.token for e in events]
    assert len(out) == n_new and events[-1].finished
    # the whole sequence through K3ForConditionalGeneration (the release form: expanded ids + pixels)
    seq = np.asarray([ids + out], np.int32)
    logits = K3ForConditionalGeneration(cfg).apply(variables, seq, media.pixel_values, media.grid_thws)
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64)[0, len(ids) - 1:-1], axis=-1)
    np.testing.assert_array_equal(np.argmax(logp, -1), out)
    np.testing.assert_allclose([e.logprob for e in events], logp[np.arange(n_new), out], atol=2e-4)
    # the media rows reach the prefill: a different image changes the first token's distribution
    other = RequestMedia(media.pixel_values[::-1].copy(), media.grid_thws, media.num_tokens, media.digests)
    rid2 = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, logprobs=0), media=other)
    events2 = []
    while engine.has_work:  # the prefill may span several steps (it is interleaved with decode)
        events2 += [e for e in engine.step() if e.request_id == rid2]
    ev = events2[0]
    assert abs(ev.logprob - events[0].logprob) > 1e-6
    # a chunk takes the rows of its own pads
    prompt = np.asarray(ids)
    first = int(np.argmax(prompt == cfg.media_placeholder_token_id))
    rows, mask = chunk_media(prompt, media.embeds, first + 3, 3, cfg.media_placeholder_token_id)
    np.testing.assert_array_equal(rows, media.embeds[3:6])
    assert mask.all()


def test_engine_refuses_inconsistent_media():
    cfg, _, tok, engine = _setup()
    ids, media = chat_request_ids(tok, _image_chat(_png((30, 30), (0, 0, 0))), cfg, MediaServingConfig(proc=PROC))
    one_less = list(ids)
    one_less.remove(cfg.media_placeholder_token_id)
    with pytest.raises(RequestError, match="holds 3 <\\|media_pad\\|> tokens.*need 4"):
        engine.validate(one_less, SamplingParams(max_tokens=2), media)
    short = [t for t in ids if t != cfg.media_placeholder_token_id]
    with pytest.raises(RequestError, match="holds 0 <\\|media_pad\\|> tokens"):
        engine.validate(short, SamplingParams(max_tokens=2), media)
    with pytest.raises(ImageError, match="more than 1 images"):
        chat_request_ids(tok, _image_chat(_png((30, 30), (0, 0, 0))) * 2, cfg, MediaServingConfig(max_items=1))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    for name in ("fastapi", "httpx", "uvicorn"):
        pytest.importorskip(name)
    from k3_jax.serving.server import create_app

    cfg, _, tok, engine = _setup()
    allowed = tmp_path_factory.mktemp("images")
    Image.new("RGB", (28, 28), (9, 9, 9)).save(allowed / "ok.png")
    app = create_app(engine, tok, model_name="mm", media=MediaServingConfig(proc=PROC, max_items=2,
                                                                           allow_dir=str(allowed)))
    with running_server(app) as (c, _):
        yield c, allowed
    assert not engine.has_work


def _chat(client, messages, **kw):
    body = {"model": "mm", "messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True, **kw}
    return client.post("/v1/chat/completions", json=body)


def test_server_answers_inline_png_and_400s_bad_images(client):
    c, allowed = client
    r = _chat(c, _image_chat(_png((60, 44), (200, 30, 10))))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["prompt_tokens"] > 6
    r = _chat(c, _image_chat(f"file://{allowed / 'ok.png'}"))  # a file under the server's --image-dir
    assert r.status_code == 200, r.text
    huge = _png((300, 300), (1, 2, 3))
    bad = [
        (_image_chat("data:image/png;base64,aGVsbG8="), "messages[0].content[1]: not an image"),
        (_image_chat("data:image/png;base64,@@@"), "not valid base64"),
        (_image_chat(huge), "larger than max_image_pixels"),
        (_image_chat("https://example.com/cat.png"), "remote fetch disabled"),
        (_image_chat("file:///etc/hostname"), "outside the server's image directory"),
        ([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}], "unsupported content part type"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}], "needs a 'url' string"),
        (_image_chat(_png((30, 30), (0, 0, 0))) * 3, "messages[2].content[1]: more than 2 images"),
    ]
    for messages, words in bad:
        r = _chat(c, messages)
        assert r.status_code == 400, (words, r.text)
        assert words in r.json()["error"]["message"], (words, r.text)
    r = _chat(c, [{"role": "user", "content": "hello"}])  # the server keeps serving
    assert r.status_code == 200, r.text
    assert c.get("/health").json()["status"] == "ok"
