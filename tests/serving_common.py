"""Shared tiny-model engine for the serving tests (one per pytest process: each model compile costs ~12 s of
CPU, so the engine, server and reference-forward tests reuse the same compiled functions)."""

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.config import load_config
from k3_jax.convert.fixture import random_params
from k3_jax.model import K3ForCausalLM
from k3_jax.serving.engine import Engine
from k3_jax.tokenizer import Tokenizer

MAX_LEN = 144


@functools.lru_cache(maxsize=1)
def tiny_setup():
    """``(cfg, variables, engine, reference_forward)`` for the fp32 tiny model with random weights.

    The engine has 3 slots of 144 tokens, prefill chunks of 16 + single tokens (2 prefill shapes), the
    bundled tokenizer and eos 2.
    """
    cfg = load_config("configs/k3-tiny.json").replace(dtype="float32")
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), random_params(cfg, seed=0))
    variables = {"params": params}
    engine = Engine(
        cfg,
        params,
        max_batch=3,
        max_len=MAX_LEN,
        prefill_chunk=16,
        prefill_mode="unit",
        tokenizer=Tokenizer.bundled(),
        eos_ids=(cfg.eos_token_id,),
        max_logprobs=5,
    )
    model = K3ForCausalLM(cfg)
    fwd = jax.jit(lambda v, x: model.apply(v, x))
    return cfg, variables, engine, fwd


def reference_greedy_check(fwd, variables, prompt, output):
    """Assert every generated token is the argmax of a from-scratch full forward over the tokens before it.

    One forward over ``prompt + output`` padded to MAX_LEN: the model is causal, so the logits at position i
    equal the from-scratch logits after i + 1 tokens.
    """
    seq = list(prompt) + list(output)
    padded = np.zeros((1, MAX_LEN), np.int32)
    padded[0, : len(seq)] = seq
    logits = np.asarray(fwd(variables, jnp.asarray(padded)))[0]
    want = logits[len(prompt) - 1 : len(seq) - 1].argmax(-1)
    mismatch = np.nonzero(want != np.asarray(output))[0]
    assert mismatch.size == 0, f"first divergence at step {mismatch[0]}: want {want[mismatch[0]]}"


@contextlib.contextmanager
def running_server(app: Any, log_level: str = "warning", timeout: float = 300) -> Iterator[tuple[Any, int]]:
    """Serve ``app`` with uvicorn on a free localhost port in a daemon thread; yields ``(httpx client, port)`` once
    the server has started, and stops it on exit (httpx/uvicorn are imported here: the serve extra)."""
    import httpx  # noqa: PLC0415
    import uvicorn  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=timeout) as c:
            yield c, port
    finally:
        server.should_exit = True
        thread.join(timeout=30)
