"""Expert parallelism for the routed experts of Stable LatentMoE inside ``jax.shard_map``.

Each device of the ``expert`` mesh axis holds ``E / n`` consecutive experts (expert ``e`` lives on rank
``e // (E / n)``); the routed-expert widths (``I``) may additionally be split over ``tensor`` (their partial
outputs are summed with ``psum``). Two strategies compute exactly
``pallas_kernels.moe.reference.moe_dispatch_combine``:

* ``"allgather"`` ("ring of experts"): the token shards of the ``expert`` axis are all-gathered, every device
  runs its own experts on the assignments that hit them (the others are masked out: they sort past the last
  group, which ``ragged_dot`` leaves at zero), and a ``psum_scatter`` returns the weighted partial sums to the
  owners of the tokens. Communication: ``T·L`` in and out per device, independent of ``k`` — good for top-16.
* ``"all_to_all"`` (dropless): each device sorts its ``T·k`` assignments by destination rank and exchanges
  exactly those rows with ``jax.lax.ragged_all_to_all`` (GPU/TPU), runs its experts on what it received and
  sends the results back the same way. XLA:CPU has no ``ragged_all_to_all``; there it is emulated with exactly
  the same semantics by an ``all_to_all`` of per-destination blocks padded to ``T·k`` rows plus a scatter
  (``ragged="emulate"``; ``"auto"`` picks by backend). Receive buffers are sized for the worst case
  (``n·T·k`` rows), so nothing is ever dropped.

When tokens are replicated over ``expert`` (the ``serve`` preset), both strategies reduce to "compute my
experts, ``psum``".

LoRA adapters of frozen experts (``adapters=``, :data:`pallas_kernels.moe.reference.ExpertAdapters`) are split
like their weight: ``b [E, r, out]`` and per-expert ``a [E, in, r]`` over ``expert``, the ``I`` side over
``tensor`` (``b``'s out for w1/w3, ``a``'s in for w2; the w2 partial ``(h a) b`` sums with the base's ``psum``),
a shared ``a`` and the scale replicated.

The tokens' own sharding (``token_axes``: the mesh axes the token dimension is split over, default the
``data``/``fsdp``/``expert`` axes that divide ``T``) is independent groups; only ``expert`` communicates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from k3_jax.parallel.mesh_axes import axis_sizes, mesh_or_active
from pallas_kernels.moe.reference import expert_ffn, num_experts_of
from pallas_kernels.mxfp4 import is_mxfp4

Strategy = Literal["allgather", "all_to_all"]
FfnFn = Callable[..., jax.Array]

DEFAULT_TOKEN_AXES: tuple[str, ...] = ("data", "fsdp", "expert")


def token_axes_for(mesh: Any, num_tokens: int, candidates: Sequence[str] = DEFAULT_TOKEN_AXES) -> tuple[str, ...]:
    """Mesh axes (of size > 1, in order) the token dimension is split over; trailing ones are dropped until
    their product divides ``num_tokens``."""
    sizes = axis_sizes(mesh)
    axes = tuple(a for a in candidates if sizes.get(a, 1) > 1)
    while axes and num_tokens % math.prod(sizes[a] for a in axes):
        axes = axes[:-1]
    return axes


def _expert_specs(experts: dict[str, Any], expert_axis: str | None, tensor_axis: str | None) -> dict[str, Any]:
    """in_specs for the expert weights: experts over ``expert_axis``, the ``I`` dimension over ``tensor_axis``."""
    specs: dict[str, Any] = {}
    for name in ("w1", "w3", "w2"):
        w = experts[name]
        if is_mxfp4(w):  # HF orientation [E, out, in/2]: I is `out` for w1/w3 and `in` for w2
            s = P(expert_axis, tensor_axis, None) if name != "w2" else P(expert_axis, None, tensor_axis)
            specs[name] = {"weight_packed": s, "weight_scale": s}
        else:  # Flax orientation [E, in, out]: I is `out` for w1/w3 and `in` for w2
            specs[name] = P(expert_axis, None, tensor_axis) if name != "w2" else P(expert_axis, tensor_axis, None)
    return specs


def _local_sort(local_ids: jax.Array, valid: jax.Array, num_local: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stable sort of rows by local expert; invalid rows go last. Returns (order, inverse, group_sizes [E_loc])."""
    key = jnp.where(valid, local_ids, num_local).astype(jnp.int32)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    inverse = jnp.argsort(order).astype(jnp.int32)
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    return order, inverse, group_sizes


def _adapter_specs(adapters: dict[str, Any], expert_axis: str | None, tensor_axis: str | None) -> dict[str, Any]:
    """in_specs for LoRA adapters ``(a, b, scale)`` of the expert weights (see the module docstring)."""
    specs: dict[str, Any] = {}
    for name, (a, _, _) in adapters.items():
        t_in, t_out = (tensor_axis, None) if name == "w2" else (None, tensor_axis)
        a_spec = P(expert_axis, t_in, None) if a.ndim == 3 else P(t_in, None)
        specs[name] = (a_spec, P(expert_axis, None, t_out), P())
    return specs


def _run_local_experts(x: jax.Array, local_ids: jax.Array, valid: jax.Array, experts: dict[str, Any],
                       ffn: FfnFn) -> jax.Array:
    """Rows ``x [R, L]`` with local expert ids ``[R]`` → expert outputs ``[R, L]`` (0 for invalid rows).
    ``experts`` may hold the local LoRA adapters under ``"adapters"`` (passed to ``ffn`` as ``adapters=``)."""
    num_local = num_experts_of(experts)
    order, inverse, group_sizes = _local_sort(local_ids, valid, num_local)
    kw = {"adapters": experts["adapters"]} if experts.get("adapters") else {}
    out_sorted = ffn(jnp.take(x, order, axis=0), group_sizes, experts["w1"], experts["w3"], experts["w2"], **kw)
    return jnp.take(out_sorted, inverse, axis=0)


# ----------------------------------------------------------------------------- ragged all-to-all
def ragged_all_to_all_emulated(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                               send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array, *,
                               axis_name: str) -> jax.Array:
    """Same semantics as ``jax.lax.ragged_all_to_all`` (inside shard_map), built from ``all_to_all``.

    Rows ``operand[input_offsets[j] : +send_sizes[j]]`` land in rank ``j``'s ``output`` at
    ``output_offsets[j]``; rows of ``output`` nobody writes keep their value. Each destination block is padded
    to ``operand.shape[0]`` rows for the exchange.
    """
    n = input_offsets.shape[0]
    rows = operand.shape[0]
    r = jnp.arange(rows, dtype=jnp.int32)
    src = input_offsets[:, None] + r[None, :]  # [n, rows]
    sent_valid = r[None, :] < send_sizes[:, None]
    blocks = jnp.take(operand, jnp.clip(src, 0, rows - 1), axis=0)  # [n, rows, ...]
    mask = sent_valid.reshape(sent_valid.shape + (1,) * (operand.ndim - 1))
    blocks = jnp.where(mask, blocks, jnp.zeros((), operand.dtype))
    recv = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=False)  # [n, rows, ...] from each sender
    # where each sender wants its rows in my output, and how many it sends
    their_offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # [n]
    del recv_sizes  # the sender-side sizes are authoritative; recv_sizes only mirrors them
    their_sizes = jax.lax.all_to_all(send_sizes, axis_name, 0, 0, tiled=True)
    dst = their_offsets[:, None] + r[None, :]
    ok = r[None, :] < their_sizes[:, None]
    dst = jnp.where(ok, dst, output.shape[0])  # out of bounds -> dropped
    return output.at[dst.reshape(-1)].set(recv.reshape((n * rows,) + operand.shape[1:]), mode="drop")


def _ragged_a2a(use_native: bool) -> Callable[..., jax.Array]:
    return jax.lax.ragged_all_to_all if use_native else ragged_all_to_all_emulated


def _use_native_ragged(ragged: str) -> bool:
    if ragged == "native":
        return True
    if ragged == "emulate":
        return False
    if ragged != "auto":
        raise ValueError(f"ragged must be 'auto', 'native' or 'emulate', got {ragged!r}")
    from pallas_kernels.registry import target_platform  # noqa: PLC0415

    return target_platform() in ("gpu", "tpu")


# ----------------------------------------------------------------------------- per-shard bodies
def _allgather_body(z, ids, w, experts, *, expert_axis, tensor_axis, tokens_split, ffn):
    """Per device: z [T_loc, L], ids/w [T_loc, k]; experts local. Returns u [T_loc, L]."""
    num_local = num_experts_of(experts)
    if tokens_split:
        z_all = jax.lax.all_gather(z, expert_axis, axis=0, tiled=True)
        ids_all = jax.lax.all_gather(ids, expert_axis, axis=0, tiled=True)
        w_all = jax.lax.all_gather(w, expert_axis, axis=0, tiled=True)
    else:
        z_all, ids_all, w_all = z, ids, w
    t, k = ids_all.shape
    first = jax.lax.axis_index(expert_axis) * num_local if expert_axis else 0
    local = ids_all.reshape(-1) - first
    valid = (local >= 0) & (local < num_local)
    x = jnp.repeat(z_all, k, axis=0)  # assignment rows, token-major
    out = _run_local_experts(x, local, valid, experts, ffn)
    if tensor_axis:
        out = jax.lax.psum(out.astype(jnp.float32), tensor_axis)
    out = out.astype(z.dtype).astype(jnp.float32).reshape(t, k, -1)
    wv = jnp.where(valid.reshape(t, k), w_all.astype(jnp.float32), 0.0)
    part = jnp.einsum("tk,tkl->tl", wv, out, precision=jax.lax.Precision.HIGHEST)
    if expert_axis:
        part = (jax.lax.psum_scatter(part, expert_axis, scatter_dimension=0, tiled=True) if tokens_split
                else jax.lax.psum(part, expert_axis))
    return part.astype(z.dtype)


def _all_to_all_body(z, ids, w, experts, *, expert_axis, tensor_axis, n_ranks, ffn, native):
    """Dropless ragged all-to-all over ``expert_axis``. z [T_loc, L]; returns u [T_loc, L]."""
    a2a = _ragged_a2a(native)
    num_local = num_experts_of(experts)
    t, k = ids.shape
    a = t * k
    flat = ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inverse = jnp.argsort(order).astype(jnp.int32)
    x_sorted = jnp.take(z, order // k, axis=0)  # [A, L], grouped by destination rank
    ids_sorted = jnp.take(flat, order)
    dest = flat // num_local
    send_sizes = jnp.bincount(dest, length=n_ranks).astype(jnp.int32)  # [n]
    input_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    sizes_all = jax.lax.all_gather(send_sizes, expert_axis, axis=0, tiled=False)  # [n_src, n_dst]
    me = jax.lax.axis_index(expert_axis)
    # my rows go to rank j at offset sum_{i<me} sizes_all[i, j]
    before_me = jnp.arange(n_ranks)[:, None] < me
    output_offsets = jnp.sum(jnp.where(before_me, sizes_all, 0), axis=0).astype(jnp.int32)
    recv_sizes = sizes_all[:, me].astype(jnp.int32)  # from each sender i
    recv_offsets = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    cap = n_ranks * a  # worst case: every assignment of every rank hits my experts
    x_recv = a2a(x_sorted, jnp.zeros((cap,) + z.shape[1:], z.dtype), input_offsets, send_sizes,
                 output_offsets, recv_sizes, axis_name=expert_axis)
    id_recv = a2a(ids_sorted, jnp.zeros((cap,), jnp.int32), input_offsets, send_sizes, output_offsets,
                  recv_sizes, axis_name=expert_axis)
    total = jnp.sum(recv_sizes)
    local = id_recv - me * num_local
    valid = jnp.arange(cap) < total
    out = _run_local_experts(x_recv, local, valid, experts, ffn)  # [cap, L]
    if tensor_axis:
        out = jax.lax.psum(out.astype(jnp.float32), tensor_axis).astype(z.dtype)
    # send results back: rows from sender i sit at recv_offsets[i]; they return to its input_offsets[me]
    back_offsets = jax.lax.all_to_all(input_offsets, expert_axis, 0, 0, tiled=True)
    y_sorted = a2a(out, jnp.zeros((a,) + z.shape[1:], out.dtype), recv_offsets, recv_sizes, back_offsets,
                   send_sizes, axis_name=expert_axis)
    y = jnp.take(y_sorted, inverse, axis=0).reshape(t, k, -1).astype(jnp.float32)
    u = jnp.einsum("tk,tkl->tl", w.astype(jnp.float32), y, precision=jax.lax.Precision.HIGHEST)
    return u.astype(z.dtype)


# ----------------------------------------------------------------------------- public API
def moe_dispatch_combine_ep(
    z: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    experts: dict[str, Any],
    *,
    mesh: Mesh | None = None,
    strategy: Strategy = "allgather",
    expert_axis: str = "expert",
    tensor_axis: str | None = "tensor",
    token_axes: Sequence[str] | None = None,
    ragged: Literal["auto", "native", "emulate"] = "auto",
    beta1: float = 4.0,
    beta2: float = 25.0,
    mxfp8_activations: bool = False,
    ffn: FfnFn | None = None,
    adapters: dict[str, Any] | None = None,
) -> jax.Array:
    """Expert-parallel ``moe_dispatch_combine``: same arguments and result (``[T, L]`` in ``z.dtype``).

    Args:
      z: ``[T, L]`` latent tokens; expert_ids ``[T, k] i32``; weights ``[T, k] f32``.
      experts: ``{"w1", "w3", "w2"}`` (bf16 ``[E, in, out]`` arrays or MXFP4 dicts), ``E`` divisible by the
        ``expert_axis`` size.
      mesh: the mesh (default: the active one from ``jax.set_mesh``).
      strategy: ``"allgather"`` or ``"all_to_all"`` (see module docstring).
      tensor_axis: mesh axis the expert ``I`` dimension is split over (``None``/size 1: not split).
      token_axes: mesh axes the token dimension is split over (default: :func:`token_axes_for`).
      ragged: ``"native"`` = ``jax.lax.ragged_all_to_all``, ``"emulate"`` = all_to_all of padded blocks,
        ``"auto"`` = native on GPU/TPU.
      ffn: ``ffn(x_sorted, group_sizes, w1, w3, w2) -> [M, L]`` (default: the reference ``expert_ffn``); with
        ``adapters`` it is called with ``adapters=`` (the local experts' adapters) as well.
      adapters: LoRA adapters of the expert weights (``{"w1": (a, b, scale), ...}``), split as the module
        docstring says.
    """
    mesh = mesh_or_active(mesh, "expert parallel")
    sizes = axis_sizes(mesh)
    e = num_experts_of(experts)
    n = sizes.get(expert_axis, 1)
    if e % n:
        raise ValueError(f"expert parallelism: num_experts={e} is not divisible by mesh axis "
                         f"{expert_axis!r}={n}")
    ex_axis = expert_axis if n > 1 else None
    t_axis = tensor_axis if tensor_axis and sizes.get(tensor_axis, 1) > 1 else None
    if t_axis:
        w1, w2 = experts["w1"], experts["w2"]
        inter = (w2["weight_scale"].shape[2] if is_mxfp4(w2) else w1.shape[2])  # I (or I/32 scale groups)
        if inter % sizes[t_axis]:
            t_axis = None  # I not divisible: keep experts whole on every tensor rank
    if token_axes is None:
        tok = token_axes_for(mesh, z.shape[0])
    else:
        tok = tuple(a for a in token_axes if sizes.get(a, 1) > 1)
        if z.shape[0] % math.prod(sizes[a] for a in tok):
            raise ValueError(f"expert parallelism: {z.shape[0]} tokens are not divisible by token axes {tok}")
    tokens_split = ex_axis is not None and ex_axis in tok
    if ffn is None:
        def ffn(x, gs, w1, w3, w2, adapters=None):
            return expert_ffn(x, gs, w1, w3, w2, beta1=beta1, beta2=beta2, mxfp8_activations=mxfp8_activations,
                              adapters=adapters)

    tok_spec = P(tok if tok else None)
    experts = {k: experts[k] for k in ("w1", "w3", "w2")}
    expert_specs = _expert_specs(experts, ex_axis, t_axis)
    if adapters:
        experts["adapters"] = dict(adapters)
        expert_specs["adapters"] = _adapter_specs(adapters, ex_axis, t_axis)
    in_specs = (tok_spec, tok_spec, tok_spec, expert_specs)
    if strategy == "allgather" or not tokens_split:
        body = lambda zz, ii, ww, ex: _allgather_body(zz, ii, ww, ex, expert_axis=ex_axis, tensor_axis=t_axis,
                                                     tokens_split=tokens_split, ffn=ffn)
    elif strategy == "all_to_all":
        native = _use_native_ragged(ragged)
        body = lambda zz, ii, ww, ex: _all_to_all_body(zz, ii, ww, ex, expert_axis=ex_axis, tensor_axis=t_axis,
                                                      n_ranks=n, ffn=ffn, native=native)
    else:
        raise ValueError(f"expert parallelism: strategy must be 'allgather' or 'all_to_all', got {strategy!r}")
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=tok_spec, check_vma=False)
    return fn(z, expert_ids.astype(jnp.int32), weights, experts)
