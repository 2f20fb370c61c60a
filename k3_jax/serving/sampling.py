"""Batched, jit-able token sampling with per-row parameters.

Every sampling knob is a per-row array (``temperature [B] f32``, ``top_k [B] i32``, ``top_p [B] f32``,
``seed [B] u32``, ``step [B] i32``), so requests with different settings share one compiled function and
joining/leaving requests never recompiles.

Per-request randomness: the key of row ``b`` at generation step ``s`` is
``fold_in(key(seed_b), s)``; a request therefore draws the same tokens whatever batch row it sits in and
whoever else is in the batch.

Rules (OpenAI / vLLM conventions):
  * ``temperature == 0`` → greedy (argmax of the raw logits); top-k / top-p are then irrelevant.
  * ``top_k <= 0`` or ``top_k >= V`` → disabled. ``top_p >= 1`` → disabled.
  * top-k is applied first, then top-p on the renormalised temperature-scaled distribution; the most
    likely token always survives.
  * Log-probs are those of the *model* distribution (``log_softmax`` of the raw logits, temperature 1),
    as OpenAI reports them, whatever the sampling settings.

Stop conditions: :func:`hit_stop_token` (device, batched) checks stop token ids; :class:`StopStrings`
(host) finds stop strings in decoded text, holding back the text that may be the start of a stop string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "SamplingParams",
    "SamplingArrays",
    "SampleOutput",
    "sample",
    "hit_stop_token",
    "StopStrings",
    "MAX_STOP_IDS",
    "INT32_MAX",
    "MAX_TEMPERATURE",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "stop_id_array",
]

MAX_STOP_IDS = 8  # stop-token-id slots per row on device (padded with -1)
INT32_MAX = 2**31 - 1  # device arrays of token ids / top_k are int32
MAX_TEMPERATURE = 100.0  # beyond this every distribution over realistic logits is uniform
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # the hold-back matcher costs O(len(stop)^2) per token


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Host-side sampling settings of one request (validated by :meth:`validate`).

    Ranges (inclusive unless noted), checked by :meth:`validate` so that every value fits the engine's
    device arrays: ``max_tokens`` integer in [1, 2**31 - 1]; ``temperature`` finite in [0, MAX_TEMPERATURE];
    ``top_p`` in (0, 1]; ``top_k`` integer in [0, 2**31 - 1] (0 or >= vocab: off); ``seed`` integer in
    [0, 2**32); at most ``MAX_STOP_IDS`` ``stop_token_ids``, each in [0, vocab); at most ``MAX_STOP_STRINGS``
    ``stop`` strings of 1 to ``MAX_STOP_STRING_CHARS`` characters; ``logprobs`` None or an integer in
    [0, max_logprobs]; ``ignore_eos`` a bool.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: no log-probs; n >= 0: chosen token's log-prob + top-n alternatives
    ignore_eos: bool = False

    def validate(self, vocab_size: int | None = None, max_logprobs: int = 20) -> SamplingParams:
        """Raise ``ValueError`` naming the bad field and its allowed range; return self when valid."""
        if not _is_int(self.max_tokens) or not (1 <= self.max_tokens <= INT32_MAX):
            raise ValueError(f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not (0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(
                f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (0 <= self.top_k <= INT32_MAX):
            raise ValueError(
                f"top_k must be an integer in [0, {INT32_MAX}] (0 disables it), got {self.top_k!r}"
            )
        if not _is_int(self.seed) or not (0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        hi = INT32_MAX + 1 if vocab_size is None else vocab_size
        for t in self.stop_token_ids:
            if not _is_int(t) or not (0 <= t < hi):
                raise ValueError(f"stop token id {t!r} outside the vocabulary [0, {hi})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any((not isinstance(s, str)) or not (1 <= len(s) <= MAX_STOP_STRING_CHARS) for s in self.stop):
            raise ValueError(
                f"stop strings must be strings of 1 to {MAX_STOP_STRING_CHARS} characters, got {self.stop!r:.200}"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or not (0 <= self.logprobs <= max_logprobs)):
            raise ValueError(f"logprobs must be an integer in [0, {max_logprobs}], got {self.logprobs!r}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        return self


class SamplingArrays(NamedTuple):
    """Device-side per-row sampling parameters, all ``[B]``."""

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array  # [B] i32, 0 = off
    top_p: jax.Array  # [B] f32, 1 = off
    seed: jax.Array  # [B] u32
    step: jax.Array  # [B] i32, index of the token being generated for that request

    @staticmethod
    def from_params(params: Sequence[SamplingParams], steps: Sequence[int] | None = None) -> SamplingArrays:
        n = len(params)
        return SamplingArrays(
            temperature=jnp.asarray([p.temperature for p in params], jnp.float32).reshape(n),
            top_k=jnp.asarray([p.top_k for p in params], jnp.int32).reshape(n),
            top_p=jnp.asarray([p.top_p for p in params], jnp.float32).reshape(n),
            seed=jnp.asarray(np.asarray([p.seed for p in params], np.uint32).reshape(n)),
            step=jnp.asarray(steps if steps is not None else [0] * n, jnp.int32).reshape(n),
        )


class SampleOutput(NamedTuple):
    tokens: jax.Array  # [B] i32
    logprob: jax.Array  # [B] f32, log-prob of the chosen token under the model distribution
    top_ids: jax.Array  # [B, n] i32 (n = num_top_logprobs, may be 0)
    top_logprobs: jax.Array  # [B, n] f32


def _row_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), step)


def _filtered_sorted_logits(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sort ``logits [B, V]`` descending, scale by temperature, mask outside top-k / top-p.

    Returns ``(masked_sorted [B, V] f32 with -inf outside, order [B, V] i32 vocab ids)``.
    """
    vocab = logits.shape[-1]
    order = jnp.argsort(-logits, axis=-1, stable=True).astype(jnp.int32)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    safe_t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = sorted_logits / safe_t
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)[:, None]
    scaled = jnp.where(rank < k, scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before this rank
    keep_p = (cum_before < top_p[:, None]) | (rank == 0) | (top_p[:, None] >= 1.0)
    return jnp.where(keep_p, scaled, -jnp.inf), order


TOP_K_CHUNK = 512
"""Width of the chunks :func:`top_k_in_chunks` cuts a row into."""

TOP_K_CHUNKED_MAX_ROWS = 256
"""Most chunks (``B·V/TOP_K_CHUNK``) for which :func:`top_k_in_chunks` chunks at all: more rows of 512 make XLA:GPU's
first pass slower than one ``top_k`` (measured on the H200, ``benchmarks/decode_small_ops.py``)."""


def top_k_in_chunks(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` of ``x [B, V]``, for few rows in two passes: the top ``k`` of each
    :data:`TOP_K_CHUNK`-wide chunk of a row, then the top ``k`` of those candidates. Same values and ids in the same
    order (ties to the lower id: candidates keep their chunks' order and, within a chunk, ``top_k``'s). XLA:GPU
    runs ``top_k`` one row per thread block: one decode row over a whole vocabulary occupies one multiprocessor,
    its chunks many. One ``top_k`` where the row is narrower than 8 chunks or not a multiple of the chunk, ``k``
    exceeds the chunk, or there would be more than :data:`TOP_K_CHUNKED_MAX_ROWS` chunks."""
    b, v = x.shape
    c = TOP_K_CHUNK
    if v % c or v < 8 * c or k > c or b * (v // c) > TOP_K_CHUNKED_MAX_ROWS:
        return jax.lax.top_k(x, k)
    vals, ids = jax.lax.top_k(x.reshape(b * (v // c), c), k)  # one row per chunk: [B·V/c, k]
    ids = ids.reshape(b, v // c, k) + (jnp.arange(v // c, dtype=ids.dtype) * c)[None, :, None]
    top, pos = jax.lax.top_k(vals.reshape(b, -1), k)
    return top, jnp.take_along_axis(ids.reshape(b, -1), pos, axis=-1)


@partial(jax.jit, static_argnames=("num_top_logprobs", "sampling"))
def sample(logits: jax.Array, params: SamplingArrays, num_top_logprobs: int = 0,
           sampling: bool = True) -> SampleOutput:
    """Draw one token per row.

    Args:
      logits: ``[B, V]`` (any float dtype; computed in f32).
      params: per-row :class:`SamplingArrays`.
      num_top_logprobs: static; how many top alternatives' log-probs to return per row.
      sampling: static; False promises that every row whose token matters is greedy (``temperature == 0``,
        known on the host): the program is the argmax alone, without the top-k / top-p sort over the vocabulary.
        True (default): rows with ``temperature > 0`` sample, the others take their argmax. Greedy rows get the
        same token either way.
    Returns: :class:`SampleOutput`.
    """
    logits = logits.astype(jnp.float32)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if sampling:
        masked, order = _filtered_sorted_logits(logits, params.temperature, params.top_k, params.top_p)
        keys = jax.vmap(_row_key)(params.seed, params.step)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
        pick_rank = jnp.argmax(masked + gumbel, axis=-1)
        sampled = jnp.take_along_axis(order, pick_rank[:, None], axis=-1)[:, 0]
        tokens = jnp.where(params.temperature > 0, sampled, tokens).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    if num_top_logprobs > 0:
        top_lp, top_ids = top_k_in_chunks(logp, num_top_logprobs)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SampleOutput(tokens, chosen, top_ids.astype(jnp.int32), top_lp)


def hit_stop_token(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """``tokens [B] i32`` vs ``stop_ids [B, S] i32`` (padded with -1) → ``[B] bool``."""
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


def stop_id_array(ids_per_row: Sequence[Sequence[int]]) -> np.ndarray:
    """Pad per-row stop token id lists to ``[B, MAX_STOP_IDS] i32`` with -1."""
    out = np.full((len(ids_per_row), MAX_STOP_IDS), -1, np.int32)
    for b, ids in enumerate(ids_per_row):
        ids = list(dict.fromkeys(ids))
        if len(ids) > MAX_STOP_IDS:
            raise ValueError(f"row {b}: {len(ids)} stop token ids > MAX_STOP_IDS={MAX_STOP_IDS}")
        out[b, : len(ids)] = ids
    return out


class StopStrings:
    """Incremental stop-string matcher over streamed text (host side).

    ``push(delta) -> (text_safe_to_emit, stopped)``. Text that could be the beginning of a stop string is
    held back until it is disambiguated; on a match the text up to (excluding) the stop string is emitted
    and ``stopped`` is True. ``flush()`` returns the held-back tail at the end of generation.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        buf = self._held + delta
        first = min(((buf.find(s), s) for s in self.stops if s in buf), default=None)
        if first is not None:
            self.stopped = True
            self._held = ""
            return buf[: first[0]], True
        # hold back the longest suffix of buf that is a proper prefix of some stop string
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out
