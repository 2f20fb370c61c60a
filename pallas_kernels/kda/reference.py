"""Pure-JAX reference for Kimi Delta Attention (KDA), spec section b.2.

Conventions follow flash-linear-attention (``fla/ops/kda``):

* ``q, k``: ``[B, T, H, K]``; ``v``: ``[B, T, H, V]``; ``g``: log-decay ``[B, T, H, K]`` (natural log,
  expected ``<= 0``; K3 produces it with :func:`kda_gate`, so it lies in ``(-5, 0)``);
  ``beta``: ``[B, T, H]``; recurrent state ``[B, H, K, V]`` fp32 (key-first, fla's default layout).
* ``scale`` defaults to ``K ** -0.5`` and multiplies ``q`` (after any L2-norm the caller applied).
* ``segment_ids [B, T]`` int (optional): packed documents. The state resets to zero *before* token ``t``
  whenever ``segment_ids[:, t] != segment_ids[:, t - 1]``. ``initial_state`` therefore only reaches the
  first document of each row; token 0 never resets (carry a state across calls by passing the previous
  call's final state).
* Both forms compute in fp32 with ``precision=HIGHEST``; outputs are cast to ``v.dtype``, the final state
  stays fp32. Both return ``(o, final_state)`` (``final_state`` is ``None`` unless requested).

Recurrence (per head, ``S`` is ``K x V``)::

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T
    o_t = S_t^T (scale * q_t)

Chunked (UT / WY) form, chunk ``C``; inside a chunk ``G_i = sum_{s<=i} g_s`` (per channel)::

    A_kk[i,j] = sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])   (j < i)
    A_qk[i,j] = sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])   (j <= i)
    [W | U]   = (I + diag(beta) A_kk)^-1 diag(beta) [exp(G) * K | V]   (unit lower-triangular solve)
    O         = (q * exp(G)) S_in + A_qk (U - W S_in)
    S_out     = diag(exp(G_C)) S_in + (exp(G_C - G) * K)^T (U - W S_in)

Implementation notes:

* Everything that does not depend on the carried state (A_kk, A_qk, the solve, W, U) is computed for all
  chunks at once; the ``lax.scan`` over chunks only applies the per-chunk affine state map
  ``S_{n+1} = M_n S_n + B_n`` with ``M_n = diag(exp(G_C)) - (exp(G_C - G) * K)^T W`` and
  ``B_n = (exp(G_C - G) * K)^T U`` (the same maps :mod:`pallas_kernels.kda.state_map` composes for
  sequence parallelism). Outputs follow as ``O = (q exp(G) - A_qk W) S_n + A_qk U``.
* ``(I + diag(beta) A_kk)^-1`` is formed by blocked doubling (:func:`_unit_lower_inverse`): log2(C) levels
  of batched matmuls instead of a 64-step forward substitution.
* no exp overflow: ``exp(G_i - G_j)`` is never factored as ``exp(G_i) exp(-G_j)`` over a chunk.
  The chunk is split into sub-tiles of ``sub_chunk_size`` tokens. For ``i`` in tile ``a`` and ``j`` in any
  earlier tile, the factorisation is taken at ``r`` = ``G`` at the last token of tile ``a - 1``:
  ``exp(G_i - r) * exp(r - G_j)``, and both exponents are ``<= 0`` for any ``g <= 0`` (no lower bound
  needed, nothing can overflow; underflow only happens where the true product is below ~1e-38). Inside a
  tile the same split recurses with tiles of a quarter the size, down to single tokens (``(i, i)`` pairs
  need no decay). No ``[.., C, C, K]``-sized pairwise tensor is formed (widest: 1.5x a ``[C, K]`` operand).
* Training memory: the chunked body runs under ``jax.checkpoint`` saving nothing but its inputs; the
  backward recomputes the forward (one extra forward of compute) instead of keeping ~130x the fp32 input
  size of intermediates per layer.
* Segment resets inside a chunk: pair terms across documents are masked to zero, the carried state only
  reaches tokens before the first reset of the chunk, and only the chunk's last document contributes to
  the outgoing state. Padding tokens (``T`` not a multiple of ``C``) have ``k = v = beta = g = 0`` and are
  exact no-ops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST

__all__ = [
    "l2norm",
    "kda_gate",
    "recurrent_kda",
    "chunk_kda",
    "segment_resets",
    "chunk_state_maps",
]


def _ein(eq: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(eq, *operands, precision=HIGHEST, preferred_element_type=jnp.float32)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x**2, -1) + eps)`` computed in fp32, returned in ``x.dtype`` (fla ``l2norm``)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("lower_bound",))
def kda_gate(
    f: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array | None = None,
    lower_bound: float = -5.0,
) -> jax.Array:
    """K3's lower-bounded log-decay ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))``.

    Args:
      f: raw gate ``[B, T, H, K]`` (any float dtype).
      A_log: ``[H]`` per-head log rate (the checkpoint's zero padding must be sliced off by the loader).
      dt_bias: ``[H * K]`` or ``[H, K]`` (optional).
      lower_bound: negative float, ``-5.0`` for K3.

    Returns:
      ``g [B, T, H, K] f32``, strictly inside ``(lower_bound, 0)`` for every finite or infinite ``f``.
      In fp32 the sigmoid saturates to exactly 1 (argument >~ 17) or 0 (argument <~ -104), which would
      give ``g == lower_bound`` or ``g == 0``; the result is therefore clamped to
      ``[nextafter(lower_bound, 0), -FLT_MIN]`` (``FLT_MIN`` = smallest normal fp32, so ``exp(g)``
      rounds to 1, a harmless no-decay step). The clamp only touches saturated values (its gradient is
      zero there, as is the sigmoid's). NaN inputs propagate as NaN.
    """
    if f.ndim != 4:
        raise ValueError(f"kda_gate: f must be [B, T, H, K], got shape {f.shape}")
    H, K = f.shape[2], f.shape[3]
    if A_log.shape != (H,):
        raise ValueError(f"kda_gate: A_log must be [H]=[{H}], got shape {A_log.shape}")
    if lower_bound >= 0:
        raise ValueError(f"kda_gate: lower_bound must be negative, got {lower_bound}")
    x = f.astype(jnp.float32)
    if dt_bias is not None:
        if dt_bias.size != H * K:
            raise ValueError(f"kda_gate: dt_bias must have H*K={H * K} entries, got shape {dt_bias.shape}")
        x = x + dt_bias.astype(jnp.float32).reshape(H, K)
    rate = jnp.exp(A_log.astype(jnp.float32))[:, None]
    g = lower_bound * jax.nn.sigmoid(rate * x)
    lo = jnp.nextafter(jnp.float32(lower_bound), jnp.float32(0.0))
    hi = -jnp.finfo(jnp.float32).tiny
    return jnp.clip(g, lo, hi)


def _check_inputs(q, k, v, g, beta, initial_state, segment_ids, name: str) -> None:
    if q.ndim != 4:
        raise ValueError(f"{name}: q must be [B, T, H, K], got shape {q.shape}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{name}: k shape {k.shape} must equal q shape {q.shape}")
    if g.shape != q.shape:
        raise ValueError(f"{name}: g shape {g.shape} must equal q shape {q.shape} ([B, T, H, K])")
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"{name}: v must be [B, T, H, V]=[{B}, {T}, {H}, V], got shape {v.shape}")
    if beta.shape != (B, T, H):
        raise ValueError(f"{name}: beta must be [B, T, H]=[{B}, {T}, {H}], got shape {beta.shape}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(
            f"{name}: initial_state must be [B, H, K, V]=[{B}, {H}, {K}, {v.shape[-1]}], "
            f"got shape {initial_state.shape}"
        )
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"{name}: segment_ids must be [B, T]=[{B}, {T}], got shape {segment_ids.shape}")
    if T < 1:
        raise ValueError(f"{name}: need at least one token, got T={T}")


def segment_resets(
    segment_ids: jax.Array | None, batch: int, length: int, prev_segment_ids: jax.Array | None = None
) -> jax.Array:
    """``[B, T] bool``: True where the state resets before token t (document id changes from t-1 to t).

    ``prev_segment_ids [B]`` (optional) is the id of the token just before this range (e.g. the last token
    of the previous sequence shard); without it token 0 never resets.
    """
    if segment_ids is None:
        return jnp.zeros((batch, length), dtype=bool)
    seg = segment_ids.astype(jnp.int32)
    first = (
        jnp.zeros((batch, 1), dtype=bool)
        if prev_segment_ids is None
        else (seg[:, :1] != prev_segment_ids.astype(jnp.int32)[:, None])
    )
    return jnp.concatenate([first, seg[:, 1:] != seg[:, :-1]], axis=1)


# ----------------------------------------------------------------------------------------------------------
# Recurrent form
# ----------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state"))
def recurrent_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Token-by-token KDA (``lax.scan`` over T). Shapes/semantics: see the module docstring.

    Returns ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32 or None)``.
    """
    _check_inputs(q, k, v, g, beta, initial_state, segment_ids, "recurrent_kda")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    f32 = jnp.float32
    qs = q.astype(f32) * scale
    S0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
    reset = segment_resets(segment_ids, B, T)

    def step(S, xs):
        qt, kt, vt, gt, bt, rt = xs  # [B,H,K] [B,H,K] [B,H,V] [B,H,K] [B,H] [B]
        S = jnp.where(rt[:, None, None, None], 0.0, S)
        S = S * jnp.exp(gt)[..., None]
        pred = _ein("bhk,bhkv->bhv", kt, S)
        S = S + _ein("bhk,bhv->bhkv", bt[..., None] * kt, vt - pred)
        o = _ein("bhk,bhkv->bhv", qt, S)
        return S, o

    xs = tuple(
        jnp.moveaxis(x, 1, 0) for x in (qs, k.astype(f32), v.astype(f32), g.astype(f32), beta.astype(f32), reset)
    )
    S, o = jax.lax.scan(step, S0, xs)
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    return o, (S if output_final_state else None)


def decode_prologue(
    q_proj: jax.Array,
    k_proj: jax.Array,
    v_proj: jax.Array,
    f_proj: jax.Array,
    b_proj: jax.Array,
    conv_tail: jax.Array,
    conv_weights: tuple[jax.Array, jax.Array, jax.Array],
    A_log: jax.Array,
    dt_bias: jax.Array | None,
    lower_bound: float = -5.0,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The one-token decode step's inputs from a KDA layer's projections: K3's causal short conv over q, k, v, SiLU,
    the per-head L2 norm of q and k, the gate (:func:`kda_gate`) and ``beta = sigmoid(b)``.

    Args:
      q_proj, k_proj: ``[B, H*K]``; v_proj: ``[B, H*V]`` (one dtype, the activations': the conv output is rounded
        to it before the SiLU, and q, k, v are returned in it).
      f_proj: ``[B, H*K]`` the raw gate; b_proj: ``[B, H]`` the beta logits.
      conv_tail: ``[B, W-1, 2*H*K + H*V]`` the previous ``W-1`` inputs of the q | k | v projections, oldest first
        (read as the projections' dtype).
      conv_weights: ``(wq [W, H*K], wk [W, H*K], wv [W, H*V])`` depthwise taps; tap ``W-1`` multiplies the current
        token. The taps' products are summed in fp32, tap 0 first.
      A_log: ``[H]``; dt_bias: ``[H*K]`` or None; lower_bound: the gate's (negative) bound.
    Returns:
      ``(q, k [B, 1, H, K], v [B, 1, H, V]`` in the projections' dtype, ``g [B, 1, H, K]`` f32,
      ``beta [B, 1, H]`` f32, the new tail ``[B, W-1, 2*H*K + H*V]`` in ``conv_tail``'s dtype: the last ``W-2`` of
      the old inputs, then this token's).
    """
    B, H = b_proj.shape
    hk, hv = q_proj.shape[-1], v_proj.shape[-1]
    if k_proj.shape != (B, hk) or v_proj.shape != (B, hv) or f_proj.shape != (B, hk) or hk % H or hv % H:
        raise ValueError(f"decode_prologue: q/k/f projections must be [B, H*K], v [B, H*V], b [B, H]; got q "
                         f"{q_proj.shape}, k {k_proj.shape}, v {v_proj.shape}, f {f_proj.shape}, b {b_proj.shape}")
    W = conv_weights[0].shape[0]
    if W < 2:
        raise ValueError(f"decode_prologue: the short conv needs at least 2 taps, got {W}")
    if conv_tail.shape != (B, W - 1, 2 * hk + hv):
        raise ValueError(f"decode_prologue: conv_tail must be [B, W-1, 2*H*K + H*V] = [{B}, {W - 1}, "
                         f"{2 * hk + hv}], got {conv_tail.shape}")
    f32 = jnp.float32
    dt = q_proj.dtype
    tails = jnp.split(conv_tail, [hk, 2 * hk], axis=-1)
    outs, new_tail = [], []
    for u, tail, w, normalize in zip((q_proj, k_proj, v_proj), tails, conv_weights, (True, True, False),
                                     strict=True):
        taps = [tail[:, j : j + 1].astype(dt) for j in range(W - 1)] + [u[:, None]]  # [B, 1, C] each
        acc = jnp.zeros((B, 1, u.shape[-1]), f32)
        for j, tap in enumerate(taps):
            acc = acc + tap.astype(f32) * w[j].astype(f32)
        y = jax.nn.silu(acc.astype(dt).astype(f32)).reshape(B, 1, H, -1)
        outs.append((l2norm(y) if normalize else y).astype(dt))
        new_tail.append(jnp.concatenate(taps[1:], axis=1))
    g = kda_gate(f_proj.reshape(B, 1, H, hk // H), A_log, dt_bias, lower_bound)
    beta = jax.nn.sigmoid(b_proj.astype(f32))[:, None]
    tail_out = jnp.concatenate(new_tail, axis=-1).astype(conv_tail.dtype)
    return outs[0], outs[1], outs[2], g, beta, tail_out


# ----------------------------------------------------------------------------------------------------------
# Chunked (UT / WY) form
# ----------------------------------------------------------------------------------------------------------


def _split_tile(C: int, sub: int) -> int:
    """Tile size used to split a block of ``C`` tokens (``sub`` if it is a proper divisor, else a quarter,
    a half, or single tokens)."""
    if sub < C and C % sub == 0:
        return sub
    if C % 4 == 0:
        return C // 4
    return C // 2 if C % 2 == 0 else 1


def _decay_products(x, k, G, sub: int, strict: bool):
    """``A[.., s, i, j] = sum_d x[.., s, i, d] k_j[d] exp(G_i[d] - G_j[d])`` for ``j < i`` (strict) or ``j <= i``.

    x: ``[..., S, C, K] f32`` (``S`` stacked left operands sharing ``k`` and the decays, e.g. ``[k, q]``);
    k, G: ``[..., C, K] f32`` (G = in-chunk cumulative log-decay, non-increasing). Returns ``[..., S, C, C]``
    (zero above the diagonal, and on it when ``strict``).

    The block is split into ``n`` tiles of ``sub`` tokens. For a row ``i`` in tile ``a >= 1`` and every
    column ``j`` in an earlier tile the factorisation is taken at ``r = G`` at the last token of tile ``a-1``:
    ``exp(G_i - r) * exp(r - G_j)``, both exponents ``<= 0`` for any ``g <= 0`` (nothing can overflow; a
    factor only underflows where the true product is below ~1e-38). This is one product of a ``[sub, K]``
    left operand with a ``[a*sub, K]`` right operand per tile, so no ``[.., C, C, K]`` (or ``[n, C, K]``)
    tensor is ever formed: the widest intermediate is the ``1.5 x`` (for ``n = 4``) stack of right operands,
    shared by the ``S`` left operands. The diagonal tiles recurse (quarter-size tiles) down to single tokens,
    where the pair ``(i, i)`` is ``sum_d x_i[d] k_i[d]`` (``exp(0) = 1``).
    """
    C, K = k.shape[-2], k.shape[-1]
    S = x.shape[-3]
    lead = k.shape[:-2]
    if C == 1:
        if strict:
            return jnp.zeros((*lead, S, 1, 1), jnp.float32)
        return jnp.sum(x * k[..., None, :, :], axis=-1, keepdims=True)
    s = _split_tile(C, sub)
    n = C // s
    # Diagonal tiles: recurse with the tile axis moved into the batch dimensions.
    xt = jnp.swapaxes(x.reshape(*lead, S, n, s, K), -4, -3)  # [..., n, S, s, K]
    diag = _decay_products(xt, k.reshape(*lead, n, s, K), G.reshape(*lead, n, s, K), s, strict)
    diag = jnp.swapaxes(diag, -4, -3)  # [..., S, n, s, s]
    rows = []
    for a in range(n):
        lo, hi = a * s, (a + 1) * s
        parts = []
        if a > 0:
            r = G[..., lo - 1 : lo, :]  # [..., 1, K]: G at the end of tile a-1
            left = x[..., lo:hi, :] * jnp.exp(G[..., lo:hi, :] - r)[..., None, :, :]  # [..., S, s, K]
            right = k[..., :lo, :] * jnp.exp(r - G[..., :lo, :])  # [..., a*s, K]
            parts.append(_ein("...sik,...jk->...sij", left, right))
        parts.append(diag[..., a, :, :])
        if a < n - 1:
            parts.append(jnp.zeros((*lead, S, s, C - hi), jnp.float32))
        rows.append(jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0])
    return jnp.concatenate(rows, axis=-2)


def unit_lower_inverse(n: jax.Array, size: int, dot) -> jax.Array:
    """``(I + N)^-1`` for strictly lower-triangular ``N [C, C]`` as matmuls, by doubling.

    With ``X_s`` the inverse of ``I + N``'s block diagonal of ``s x s`` blocks (``X_1 = I``), merging neighbouring
    blocks uses ``[[A, 0], [M, B]]^-1 = [[A^-1, 0], [-B^-1 M A^-1, B^-1]]``: ``X_2s = X_s - X_s (N_s X_s)``, ``N_s``
    the lower-left ``s x s`` blocks of the ``2s`` diagonal blocks. Every intermediate is a block of the exact
    inverse, bounded wherever the inverse is (the delta rule's is: aligned keys give entries of at most 1), where
    the Neumann product ``(I - N)(I + N^2)...`` forms powers of ``N`` whose entries reach binomial sizes
    (``~1e17`` at 64 aligned keys) and cancel only in exact arithmetic. ``2 (log2(C) - 1)`` products of
    ``C x C`` matrices; ``dot(a, b)`` is the caller's fp32 matmul (batched over leading dims of ``n``, if any);
    ``size`` a power of two. The kernels call it inside their bodies; :func:`_unit_lower_inverse` is its reference
    use.
    """
    row = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)

    def lower_left(level: int):  # blocks of s = 2^level: block row = block column + 1, block row odd
        br, bc = jax.lax.shift_right_logical(row, level), jax.lax.shift_right_logical(col, level)
        return (br == bc + 1) & (jax.lax.bitwise_and(br, 1) == 1)

    x = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32) - jnp.where(lower_left(0), n, 0.0)
    level = 1
    while (1 << level) < size:
        x = x - dot(x, dot(jnp.where(lower_left(level), n, 0.0), x))
        level += 1
    return x


def _unit_lower_inverse(L):
    """``(I + tril(L, -1))^-1`` for ``L [..., C, C]`` (only the strictly lower part is read): :func:`unit_lower_inverse`
    with batched fp32 ``HIGHEST`` matmuls, ``C`` padded to a power of two."""
    C = L.shape[-1]
    P = 1 << max(C - 1, 0).bit_length()
    if P != C:
        L = jnp.pad(L, [(0, 0)] * (L.ndim - 2) + [(0, P - C), (0, P - C)])
    return unit_lower_inverse(L, P, lambda a, b: _ein("...ij,...jk->...ik", a, b))[..., :C, :C]


def _chunk_prepare(k, v, g, beta, reset, chunk_size: int, sub_chunk_size: int, q=None):
    """State-independent part of the chunked form, for all chunks at once.

    Inputs are ``[B, T, H, D]`` f32 (``q`` already scaled, optional), ``beta [B, T, H]``, ``reset [B, T]``.
    Returns a dict of ``[B, H, N, ...]`` f32 arrays: ``M`` (``[K, K]`` chunk state maps), ``Bm``
    (``[K, V]``), and when ``q`` is given ``Qp`` (``[C, K]``: q exp(G) - A_qk W) and ``Ointra``
    (``[C, V]``: A_qk U).
    """
    B, T, H, K = k.shape
    C = chunk_size
    N = -(-T // C)
    Tp = N * C
    pad = Tp - T

    def prep(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, N, C, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    kc, vc, gc, bc = prep(k), prep(v), prep(g), prep(beta)  # bc: [B, H, N, C]
    rc = jnp.pad(reset, [(0, 0), (0, pad)]).reshape(B, N, C)
    segidx = jnp.cumsum(rc.astype(jnp.int32), axis=-1)  # document index inside the chunk
    carry = (segidx == 0)[:, None, :, :, None].astype(jnp.float32)  # [B,1,N,C,1] sees S_in
    same = (segidx[..., :, None] == segidx[..., None, :])[:, None]  # [B,1,N,C,C]
    lastseg = (segidx == segidx[..., -1:])[:, None, :, :, None].astype(jnp.float32)

    G = jnp.cumsum(gc, axis=-2)  # [B,H,N,C,K], <= 0
    Glast = G[..., -1:, :]
    if q is None:
        Akk = _decay_products(kc[..., None, :, :], kc, G, sub_chunk_size, strict=True)[..., 0, :, :]
    else:  # one pass for both: the decay factors depend only on G (stacked operand axis -3)
        qc = prep(q)
        both = _decay_products(jnp.stack([kc, qc], axis=-3), kc, G, sub_chunk_size, strict=False)
        Akk, Aqk = both[..., 0, :, :], both[..., 1, :, :]
        Aqk = jnp.where(same, Aqk, 0.0)
    Akk = jnp.where(same, Akk, 0.0)
    L = bc[..., None] * Akk  # only its strictly lower part is read by _unit_lower_inverse
    rhs = bc[..., None] * jnp.concatenate([kc * jnp.exp(G) * carry, vc], axis=-1)  # [.., C, K+V]
    WU = _ein("...ij,...jd->...id", _unit_lower_inverse(L), rhs)
    W, U = WU[..., :K], WU[..., K:]
    kdec = kc * jnp.exp(Glast - G) * lastseg  # [.., C, K]
    decay = jnp.exp(Glast[..., 0, :]) * carry[..., -1, :]  # [B,H,N,K]
    M = decay[..., :, None] * jnp.eye(K, dtype=jnp.float32) - _ein("...ck,...cj->...kj", kdec, W)
    Bm = _ein("...ck,...cv->...kv", kdec, U)
    out = {"M": M, "Bm": Bm}
    if q is not None:
        out["Qp"] = qc * jnp.exp(G) * carry - _ein("...ij,...jk->...ik", Aqk, W)
        out["Ointra"] = _ein("...ij,...jv->...iv", Aqk, U)
    return out


def _check_chunking(chunk_size: int, sub_chunk_size: int, name: str) -> None:
    if chunk_size < 1 or sub_chunk_size < 1 or chunk_size % sub_chunk_size:
        raise ValueError(
            f"{name}: chunk_size ({chunk_size}) must be a positive multiple of sub_chunk_size ({sub_chunk_size})"
        )


@functools.partial(jax.jit, static_argnames=("chunk_size", "sub_chunk_size"))
def chunk_state_maps(
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    reset: jax.Array,
    chunk_size: int = 64,
    sub_chunk_size: int = 16,
) -> tuple[jax.Array, jax.Array]:
    """Per-chunk affine state maps ``S_{n+1} = M[:, :, n] S_n + Bm[:, :, n]``.

    Args: ``k, g [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``, ``reset [B, T] bool`` (see
    :func:`segment_resets`). Returns ``M [B, H, N, K, K] f32`` and ``Bm [B, H, N, K, V] f32``,
    ``N = ceil(T / chunk_size)``.
    """
    _check_chunking(chunk_size, sub_chunk_size, "chunk_state_maps")
    f32 = jnp.float32
    out = _chunk_prepare(
        k.astype(f32), v.astype(f32), g.astype(f32), beta.astype(f32), reset, chunk_size, sub_chunk_size
    )
    return out["M"], out["Bm"]


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "chunk_size", "sub_chunk_size"))
def chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    sub_chunk_size: int = 16,
) -> tuple[jax.Array, jax.Array | None]:
    """Chunked (UT / WY) KDA; any ``T`` (padded internally). Same semantics as :func:`recurrent_kda`.

    ``sub_chunk_size`` is the tile used for the overflow-safe intra-chunk products (must divide
    ``chunk_size``). Returns ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32 or None)``.
    """
    _check_inputs(q, k, v, g, beta, initial_state, segment_ids, "chunk_kda")
    sub_chunk_size = min(sub_chunk_size, chunk_size)
    _check_chunking(chunk_size, sub_chunk_size, "chunk_kda")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    reset = segment_resets(segment_ids, B, T)
    S0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state
    body = functools.partial(_chunk_forward, scale=scale, chunk_size=chunk_size, sub_chunk_size=sub_chunk_size)
    o, S_final = jax.checkpoint(body, policy=_SAVE_POLICY)(q, k, v, g, beta, S0, reset)
    return o, (S_final if output_final_state else None)


# Residuals autodiff keeps for the backward of chunk_kda: only its inputs. Everything else (the intra-chunk
# decay products, the WY inverse, the per-chunk maps and states) is recomputed in the backward pass, which costs
# one extra forward of the reference but keeps the saved memory per KDA layer at the size of its inputs (the
# plain VJP saved ~30x the fp32 input size, e.g. 15.8 GiB at B=16, T=2048, H=8, K=V=128).
_SAVE_POLICY = jax.checkpoint_policies.nothing_saveable


def _chunk_forward(q, k, v, g, beta, S0, reset, *, scale: float, chunk_size: int, sub_chunk_size: int):
    """Body of :func:`chunk_kda` (run under ``jax.checkpoint``): returns ``(o in v.dtype, S_final f32)``."""
    B, T, H, _ = q.shape
    V = v.shape[-1]
    f32 = jnp.float32
    p = _chunk_prepare(
        k.astype(f32),
        v.astype(f32),
        g.astype(f32),
        beta.astype(f32),
        reset,
        chunk_size,
        sub_chunk_size,
        q=q.astype(f32) * scale,
    )

    def step(S, mb):
        M, Bm = mb
        return _ein("bhkj,bhjv->bhkv", M, S) + Bm, S

    S_final, S_starts = jax.lax.scan(
        step, S0.astype(f32), (jnp.moveaxis(p["M"], 2, 0), jnp.moveaxis(p["Bm"], 2, 0))
    )
    S_starts = jnp.moveaxis(S_starts, 0, 2)  # [B, H, N, K, V]: state entering each chunk
    o = _ein("bhnck,bhnkv->bhncv", p["Qp"], S_starts) + p["Ointra"]  # [B, H, N, C, V]
    N = o.shape[2]
    o = jnp.moveaxis(o, 1, 3).reshape(B, N * chunk_size, H, V)[:, :T]
    return o.astype(v.dtype), S_final
