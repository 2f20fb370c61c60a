"""Pure-JAX reference for the LatentMoE routed experts (the ``xla`` backend of ``pallas_kernels.moe.ops``).

Everything here is jit-able with static shapes and differentiable; the Pallas kernels are tested against it.

Conventions
- Rows of ``x_sorted`` are sorted by expert; ``group_sizes [E] i32`` counts rows per expert; rows past
  ``sum(group_sizes)`` produce zeros (``jax.lax.ragged_dot`` semantics).
- Expert weights: bf16 layout ``w1, w3 [E, L, I]``, ``w2 [E, I, L]`` (Flax ``[in, out]`` per expert), or MXFP4
  dicts ``{"weight_packed": u8 [E, out, in/2], "weight_scale": u8 [E, out, in/32]}`` (HF ``[out, in]``).
- LoRA adapters beside frozen expert weights (:data:`ExpertAdapter`, keyed ``"w1"``/``"w3"``/``"w2"``): the
  low-rank path runs on the activations, ``x W_e + s·(x A)·B_e`` (shared A) or ``x W_e + s·(x A_e)·B_e``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.mxfp4 import is_mxfp4, unpack_mxfp4
from pallas_kernels.mxfp8 import fake_quant_mxfp8
from pallas_kernels.registry import target_platform

ExpertWeight = jax.Array | dict[str, jax.Array]
ExpertAdapter = tuple[jax.Array, jax.Array, jax.Array]
"""LoRA adapter of one expert weight ``[E, in, out]``: ``(a, b, scale)`` with ``a [in, r]`` (shared by all experts)
or ``[E, in, r]`` (per expert), ``b [E, r, out]``, ``scale`` f32 ``[]``."""
ExpertAdapters = dict[str, ExpertAdapter]
"""Adapters by expert weight name (``"w1"``, ``"w3"``, ``"w2"``; any subset)."""


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: jnp.dtype | None = None,
    platform: str | None = None,
) -> jax.Array:
    """``lhs [M, K]`` x ``rhs [E, K, N]`` per group -> ``[M, N]``.

    Row block ``g`` (``group_sizes[g]`` rows, in order) is multiplied by ``rhs[g]``; trailing rows beyond
    ``sum(group_sizes)`` give 0. ``rhs`` is cast to ``lhs.dtype``; f32 inputs use HIGHEST precision.
    Output dtype: ``preferred_element_type`` or ``lhs.dtype``.

    ``jax.lax.ragged_dot`` on GPU/TPU. XLA:CPU lowers ``ragged_dot`` ~30x slower than a dense matmul of the same
    FLOPs, so when the target platform (``platform`` or :func:`pallas_kernels.registry.target_platform`) is CPU
    the same product is computed by :func:`grouped_matmul_tiled` (identical semantics).
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul: expected lhs [M, K], rhs [E, K, N]; got {lhs.shape}, {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"grouped_matmul: group_sizes must be [E={rhs.shape[0]}], got {group_sizes.shape}")
    out_dtype = preferred_element_type or lhs.dtype
    if target_platform(platform) == "cpu":
        return grouped_matmul_tiled(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
    return jax.lax.ragged_dot(
        lhs,
        rhs.astype(lhs.dtype),
        group_sizes.astype(jnp.int32),
        # HIGHEST only for f32 (exact references); TPU's ragged_dot rejects it for bf16 operands.
        precision=jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None,
        preferred_element_type=out_dtype,
    )


def grouped_matmul_tiled(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tile: int = 64,
    preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
    """:func:`grouped_matmul` as a batch of ``[tile, K] x [K, N]`` products (megablox's schedule in plain JAX).

    Rows are cut into ``ceil(M / tile)`` tiles; a work item is a (tile, group) pair whose rows overlap, so there
    are at most ``tiles + E - 1`` items (a static bound). Each item multiplies its whole tile by ``rhs[group]``
    and keeps only that group's rows; items are scatter-added back. FLOPs ≤ (1 + E·tile/M) x the ragged product.
    Differentiable by plain autodiff (gathers, one batched einsum, a scatter-add).
    """
    m, k = lhs.shape
    e, _, n = rhs.shape
    out_dtype = preferred_element_type or lhs.dtype
    tiles = max(1, -(-m // tile))
    items = tiles + e - 1
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first_tile = starts // tile
    last_tile = jnp.maximum(ends - 1, 0) // tile
    count = jnp.where(sizes > 0, last_tile - first_tile + 1, 0)  # tiles each group touches
    item_end = jnp.cumsum(count)
    item = jnp.arange(items, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(item_end, item, side="right"), e - 1).astype(jnp.int32)
    valid = item < item_end[-1]
    tile_idx = jnp.where(valid, first_tile[group] + item - (item_end[group] - count[group]), 0)
    padded = jnp.pad(lhs, ((0, tiles * tile - m), (0, 0))).reshape(tiles, tile, k)
    x = padded[tile_idx]  # [items, tile, K]
    w = rhs.astype(lhs.dtype)[group]  # [items, K, N]
    prec = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    y = jnp.einsum("itk,ikn->itn", x, w, precision=prec, preferred_element_type=jnp.float32)
    rows = tile_idx[:, None] * tile + jnp.arange(tile)[None, :]
    keep = valid[:, None] & (rows >= starts[group][:, None]) & (rows < ends[group][:, None])
    y = jnp.where(keep[..., None], y, 0.0)
    out = jnp.zeros((tiles, tile, n), jnp.float32).at[tile_idx].add(y)
    return out.reshape(tiles * tile, n)[:m].astype(out_dtype)


def _situ_glu_f32(g: jax.Array, u: jax.Array, beta1: float, beta2: float) -> jax.Array:
    act = beta1 * jnp.tanh(g / beta1) * jax.nn.sigmoid(g)
    return act * (beta2 * jnp.tanh(u / beta2))


def situ_glu(gate: jax.Array, up: jax.Array, beta1: float = 4.0, beta2: float = 25.0) -> jax.Array:
    """SiTU-GLU: ``[b1*tanh(g/b1)*sigmoid(g)] * [b2*tanh(u/b2)]`` in f32, cast back to ``gate.dtype``.

    Under ``jax.checkpoint``: autodiff keeps only ``gate`` and ``up`` (the GEMM outputs, in their dtype) and the
    backward recomputes the f32 chain, instead of saving its seven f32 intermediates (``[T·k, I]`` each: 1.3 GiB
    per 4k tokens for one K3-width MoE layer's routed experts).
    """
    return _situ_glu_recomputed(gate, up, float(beta1), float(beta2))


@functools.partial(jax.checkpoint, static_argnums=(2, 3))
def _situ_glu_recomputed(gate: jax.Array, up: jax.Array, beta1: float, beta2: float) -> jax.Array:
    return _situ_glu_f32(gate.astype(jnp.float32), up.astype(jnp.float32), beta1, beta2).astype(gate.dtype)


def situ_epilogue(beta1: float, beta2: float, dtype):
    """SiTU-GLU as a fused-kernel epilogue: ``f(gate f32, up f32) -> f32``.

    ``gate``/``up`` are the f32 accumulators of ``x @ w1`` and ``x @ w3``; they are rounded to ``dtype`` first,
    as the unfused path stores them, so fused and unfused kernels agree with :func:`situ_glu`.
    """

    def f(gate: jax.Array, up: jax.Array) -> jax.Array:
        return _situ_glu_f32(gate.astype(dtype).astype(jnp.float32), up.astype(dtype).astype(jnp.float32),
                             beta1, beta2)

    return f


def dense_expert_weight(w: ExpertWeight, dtype: jnp.dtype) -> jax.Array:
    """Expert weight in the ``[E, in, out]`` layout: arrays pass through (cast), MXFP4 dicts are dequantized
    from HF ``[E, out, in]`` and transposed."""
    if is_mxfp4(w):
        return jnp.swapaxes(unpack_mxfp4(w["weight_packed"], w["weight_scale"], dtype), -1, -2)
    if isinstance(w, dict):
        raise ValueError(f"expert weight dict must have 'weight_packed' and 'weight_scale', got {sorted(w)}")
    return w.astype(dtype)


def expert_dims(w: ExpertWeight) -> tuple[int, int, int]:
    """``(E, in, out)`` of an expert weight (``[E, in, out]`` array or MXFP4 dict of HF ``[E, out, in/2]``)."""
    if is_mxfp4(w):
        e, n, kh = w["weight_packed"].shape[-3:]
        return int(e), 2 * int(kh), int(n)
    return tuple(int(d) for d in w.shape[-3:])  # type: ignore[return-value]


def check_adapters(adapters: ExpertAdapters, weights: dict[str, ExpertWeight]) -> None:
    """Raise ``ValueError`` naming the adapter leaf when ``adapters`` do not fit ``weights`` (``{"w1", "w3",
    "w2"}``): unknown weight name, ``a`` neither ``[in, r]`` nor ``[E, in, r]``, ``b`` not ``[E, r, out]``, a
    non-scalar ``scale``."""
    for name, adapter in adapters.items():
        if name not in weights:
            raise ValueError(f"expert adapter {name!r}: no such expert weight (expected one of {sorted(weights)})")
        if not isinstance(adapter, tuple | list) or len(adapter) != 3:
            raise ValueError(f"expert adapter {name!r}: expected (a, b, scale), got {type(adapter).__name__}")
        a, b, s = adapter
        e, din, dout = expert_dims(weights[name])
        r = b.shape[-2] if b.ndim == 3 else -1
        if tuple(a.shape) not in ((din, r), (e, din, r)):
            raise ValueError(f"expert adapter {name}_lora_a: expected [{din}, r] (shared) or [{e}, {din}, r] "
                             f"(per expert) with the rank r={r} of {name}_lora_b, got {tuple(a.shape)}")
        if tuple(b.shape) != (e, r, dout):
            raise ValueError(f"expert adapter {name}_lora_b: expected [{e}, r, {dout}] for weight {name} "
                             f"[E={e}, in={din}, out={dout}], got {tuple(b.shape)}")
        if jnp.ndim(s) != 0:
            raise ValueError(f"expert adapter {name}_lora_scale: expected a scalar, got shape {jnp.shape(s)}")


GroupedMatmul = Callable[[jax.Array, jax.Array], jax.Array]
"""``gmm(lhs [M, K], rhs [E, K, N]) -> f32 [M, N]`` over fixed group sizes (a backend's grouped matmul)."""


def lora_product(x: jax.Array, adapter: ExpertAdapter, gmm: GroupedMatmul) -> jax.Array:
    """The low-rank term ``scale · (x A) B_e`` of expert-sorted rows ``x [M, in]`` -> f32 ``[M, out]``.

    ``x A``: one dense ``[M, in] x [in, r]`` matmul (shared A) or a grouped one (per-expert ``A_e``), accumulated
    in f32 and rounded to ``x.dtype`` (as :class:`k3_jax.layers.common.Linear`'s adapter path); ``(x A) B_e``: the
    grouped matmul ``gmm`` over rank ``r``. Rows past ``sum(group_sizes)`` give 0 (``gmm`` leaves them 0).
    """
    a, b, s = adapter
    dt = x.dtype
    if a.ndim == 2:
        prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
        xa = jnp.matmul(x, a.astype(dt), precision=prec, preferred_element_type=jnp.float32).astype(dt)
    else:
        xa = gmm(x, a.astype(dt)).astype(dt)
    return gmm(xa, b.astype(dt)) * jnp.asarray(s, jnp.float32)


def expert_ffn(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w1: ExpertWeight,
    w3: ExpertWeight,
    w2: ExpertWeight,
    *,
    beta1: float = 4.0,
    beta2: float = 25.0,
    mxfp8_activations: bool = False,
    platform: str | None = None,
    adapters: ExpertAdapters | None = None,
) -> jax.Array:
    """Routed experts ``E_e(x) = w2_e(SiTU-GLU(w1_e x, w3_e x))`` on expert-sorted rows.

    Args:
      x_sorted: ``[M, L]`` (bf16 or f32), sorted by expert.
      group_sizes: ``[E] i32``.
      w1, w3: ``[E, L, I]`` or MXFP4 ``{"weight_packed": u8 [E, I, L/2], "weight_scale": u8 [E, I, L/32]}``.
      w2: ``[E, I, L]`` or MXFP4 ``{"weight_packed": u8 [E, L, I/2], "weight_scale": u8 [E, L, I/32]}``.
      mxfp8_activations: fake-quantize the inputs of every expert matmul to MXFP8 (SGLang emulation); the
        adapters see the same (quantized) inputs as their weight.
      platform: the target platform of the grouped matmuls (see :func:`grouped_matmul`).
      adapters: LoRA adapters of some of ``w1/w3/w2`` (:data:`ExpertAdapters`): each adapted product gets
        :func:`lora_product` added to its f32 accumulator before the rounding, e.g.
        ``gate = x W1_e + s·(x A1) B1_e``. MXFP4 weights are decoded whole here (this is the reference).
    Returns:
      ``[M, L]`` in ``x_sorted.dtype``; matmuls accumulate in f32, each product is rounded to the input dtype.
    """
    dt = x_sorted.dtype
    adapters = adapters or {}
    check_adapters(adapters, {"w1": w1, "w3": w3, "w2": w2})
    gmm = lambda lhs, rhs: grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=jnp.float32,
                                          platform=platform)

    def product(lhs: jax.Array, name: str, w: ExpertWeight) -> jax.Array:
        out = gmm(lhs, dense_expert_weight(w, dt))
        return out + lora_product(lhs, adapters[name], gmm) if name in adapters else out

    a = fake_quant_mxfp8(x_sorted) if mxfp8_activations else x_sorted
    gate, up = product(a, "w1", w1), product(a, "w3", w3)
    h = situ_glu(gate.astype(dt), up.astype(dt), beta1, beta2)
    if mxfp8_activations:
        h = fake_quant_mxfp8(h)
    return product(h, "w2", w2).astype(dt)


def layer_of(w: ExpertWeight, layer: jax.Array) -> ExpertWeight:
    """Layer ``layer`` (i32 scalar, clamped like ``dynamic_slice``) of a stacked expert weight ``[L, ...]``
    (an array or an MXFP4 dict of stacked arrays)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), w)


def num_experts_of(experts: dict[str, Any]) -> int:
    """Number of experts E from an experts dict (keys w1, w3, w2; arrays or MXFP4 dicts)."""
    w1 = experts["w1"]
    return int((w1["weight_packed"] if is_mxfp4(w1) else w1).shape[0])


COUNTING_SORT_MAX = 4096
"""Up to this many assignments (``T * k``: decode batches), :func:`sort_by_expert` ranks by comparisons, three
``[T*k, T*k]``-sized compare-and-count reductions (a few fusions), instead of two sorts and a scatter."""


def sort_by_expert(expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Flatten ``expert_ids [T, k] i32`` and sort stably by expert.

    Returns ``(order [T*k] i32, inverse [T*k] i32, group_sizes [E] i32)`` where ``order`` lists flattened
    assignment indices (token = index // k) in expert order and ``inverse`` undoes it; ids in ``[0, E)``. The same
    integers from either method (:data:`COUNTING_SORT_MAX`).
    """
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    if flat.shape[0] <= COUNTING_SORT_MAX:
        return _sort_by_counting(flat, num_experts)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inverse = jnp.argsort(order).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, inverse, group_sizes


def _sort_by_counting(flat: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`sort_by_expert` of ``flat [N] i32`` by ranking: assignment ``i``'s place in the stable order is the
    number of assignments before it in ``(expert, index)`` order."""
    n = flat.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    other, this = flat[None, :], flat[:, None]
    before = (other < this) | ((other == this) & (idx[None, :] < idx[:, None]))
    inverse = jnp.sum(before, axis=1, dtype=jnp.int32)
    order = jnp.sum(jnp.where(inverse[None, :] == idx[:, None], idx[None, :], 0), axis=1, dtype=jnp.int32)
    group_sizes = jnp.sum(other == jnp.arange(num_experts, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32)
    return order, inverse, group_sizes


def dispatch_combine(
    z: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    num_experts: int,
    ffn: Callable[[jax.Array, jax.Array], jax.Array],
) -> jax.Array:
    """Dropless dispatch -> ``ffn(x_sorted [T*k, L], group_sizes [E]) -> [T*k, L]`` -> weighted combine.

    ``u = cast(sum_k weights[t, k] * f32(out[t, k]), z.dtype)``.
    """
    t, k = expert_ids.shape
    if z.shape[0] != t or weights.shape != (t, k):
        raise ValueError(
            f"dispatch: z {z.shape}, expert_ids {expert_ids.shape}, weights {weights.shape} are inconsistent"
        )
    order, inverse, group_sizes = sort_by_expert(expert_ids, num_experts)
    x_sorted = dispatch_rows(z, order, inverse, k)
    out_sorted = ffn(x_sorted, group_sizes)
    return _weighted_combine(weights, undispatch_rows(out_sorted, order, inverse).reshape(t, k, -1), z.dtype)


# Row permutations of the dispatch with gather-only backwards. Autodiff of ``jnp.take`` is a scatter-add
# (atomic, in the rows' dtype, order-dependent on GPU); since ``order``/``inverse`` are a permutation of the
# T·k assignments, each transpose is a gather instead (and the k copies of a token sum in f32).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch_rows(z: jax.Array, order: jax.Array, inverse: jax.Array, k: int) -> jax.Array:
    """``z [T, L]`` -> ``[T·k, L]`` in expert order: row ``i`` is token ``order[i] // k``."""
    return jnp.take(z, jax.lax.div(order, jnp.int32(k)), axis=0)  # order >= 0: no floor-division fix-ups


def _dispatch_rows_fwd(z, order, inverse, k):
    return dispatch_rows(z, order, inverse, k), inverse


def _dispatch_rows_bwd(k, inverse, g):
    dz = jnp.take(g, inverse, axis=0).reshape(-1, k, g.shape[-1]).astype(jnp.float32).sum(axis=1)
    return dz.astype(g.dtype), None, None


dispatch_rows.defvjp(_dispatch_rows_fwd, _dispatch_rows_bwd)


@jax.custom_vjp
def undispatch_rows(out_sorted: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """``out_sorted [T·k, L]`` (expert order) -> ``[T·k, L]`` in assignment order (``t·k + j``)."""
    return jnp.take(out_sorted, inverse, axis=0)


def _undispatch_rows_fwd(out_sorted, order, inverse):
    return undispatch_rows(out_sorted, order, inverse), order


def _undispatch_rows_bwd(order, g):
    return jnp.take(g, order, axis=0), None, None


undispatch_rows.defvjp(_undispatch_rows_fwd, _undispatch_rows_bwd)


@functools.partial(jax.checkpoint, static_argnums=(2,))
def _weighted_combine(weights: jax.Array, out: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``cast(sum_k weights[t, k] · f32(out[t, k]), dtype)``; the backward re-widens ``out`` instead of keeping
    an f32 copy of it."""
    u = jnp.einsum("tk,tkl->tl", weights.astype(jnp.float32), out.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return u.astype(dtype)


def moe_dispatch_combine(
    z: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    experts: dict[str, Any],
    *,
    beta1: float = 4.0,
    beta2: float = 25.0,
    mxfp8_activations: bool = False,
    adapters: ExpertAdapters | None = None,
) -> jax.Array:
    """Routed-expert part of Stable LatentMoE: ``u = bf16(sum_{e in I} p_e * f32(E_e(z)))``.

    Args:
      z: ``[T, L]`` latent tokens (bf16 or f32).
      expert_ids: ``[T, k] i32`` selected experts.
      weights: ``[T, k] f32`` routing weights.
      experts: ``{"w1", "w3", "w2"}`` arrays or MXFP4 dicts (see :func:`expert_ffn`).
      adapters: LoRA adapters of the expert weights (see :func:`expert_ffn`).
    Returns:
      ``[T, L]`` in ``z.dtype``.
    """
    def ffn(x_sorted: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return expert_ffn(
            x_sorted, group_sizes, experts["w1"], experts["w3"], experts["w2"],
            beta1=beta1, beta2=beta2, mxfp8_activations=mxfp8_activations, adapters=adapters,
        )

    return dispatch_combine(z, expert_ids, weights, num_experts_of(experts), ffn)
