"""Next-token cross-entropy in chunks, so ``[tokens, vocab]`` logits for a whole batch never exist at once.

``hidden [B, T, D]`` (final normed hidden of ``model.apply(..., return_hidden=True)``) is flattened to
``[N, D]`` and cut into chunks of ``chunk_size`` tokens; for each chunk the logits ``[C, V] f32`` are made
against ``lm_head [D, V]``, reduced to per-token loss and dropped. Each chunk is wrapped in
``jax.checkpoint`` and the chunks run under ``lax.scan``, so the backward pass recomputes one chunk's logits
at a time: peak logits memory is ``C·V·4`` bytes instead of ``N·V·4``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_jax.layers.common import einsum_f32


def chunked_cross_entropy(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, mask: jax.Array,
                          *, chunk_size: int = 1024, compute_dtype=None
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sum of masked next-token losses.

    Args:
      hidden: ``[B, T, D]`` (any float dtype).
      kernel: ``[D, V]`` lm_head kernel (f32 master weights; cast to ``compute_dtype`` for the matmul).
      targets: ``[B, T]`` int target ids.
      mask: ``[B, T]`` bool/0-1, which positions count.
      chunk_size: tokens per chunk (the last chunk is padded with masked rows).
      compute_dtype: matmul input dtype (default: ``hidden.dtype``); accumulation is always f32.
    Returns:
      ``(loss_sum f32, num_tokens f32, num_correct f32)`` — divide the first by the second for the mean.
    """
    b, t, d = hidden.shape
    n = b * t
    dt = compute_dtype or hidden.dtype
    c = max(1, min(chunk_size, n))
    n_chunks = -(-n // c)
    pad = n_chunks * c - n
    h = hidden.reshape(n, d)
    y = targets.reshape(n).astype(jnp.int32)
    m = mask.reshape(n).astype(jnp.float32)
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        y = jnp.pad(y, (0, pad))
        m = jnp.pad(m, (0, pad))
    h = h.reshape(n_chunks, c, d)
    y = y.reshape(n_chunks, c)
    m = m.reshape(n_chunks, c)
    @jax.checkpoint
    def chunk_loss(h_c, y_c, m_c, w):
        # w stays in its master dtype across the scan (its gradient sums over chunks in f32); the product
        # runs in dt with an fp32 accumulator, and in dt again in the backward (einsum_f32)
        logits = einsum_f32("cd,dv->cv", h_c.astype(dt), w.astype(dt))
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, y_c[:, None], axis=-1)[:, 0]
        correct = (jnp.argmax(logits, axis=-1) == y_c).astype(jnp.float32)
        return jnp.sum((lse - tgt) * m_c), jnp.sum(correct * m_c)

    def body(carry, xs):
        loss, acc = chunk_loss(*xs, kernel)
        return (carry[0] + loss, carry[1] + jax.lax.stop_gradient(acc)), None

    (loss_sum, correct), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)),
                                          (h, y, m))
    return loss_sum, jnp.sum(m), correct


def reference_cross_entropy(hidden, kernel, targets, mask):
    """Unchunked reference (materialises all logits): ``(loss_sum, num_tokens)``."""
    logits = jnp.einsum("btd,dv->btv", hidden.astype(jnp.float32), kernel.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    mask = mask.astype(jnp.float32)
    return jnp.sum(nll * mask), jnp.sum(mask)
