"""SiTU-GLU MLPs and Stable LatentMoE.

* :class:`SituMLP` — dense SiTU-GLU MLP (layer 0's ``mlp`` and the fused shared experts).
* :func:`route` — fp32 sigmoid router; the correction bias steers *selection only*.
* :class:`LatentMoE` — router → latent down-projection → routed experts (dropless sort-based dispatch) →
  RMSNorm of the aggregated routed output → up-projection, plus the shared SiTU MLP on full width.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3_jax.config import K3Config
from k3_jax.layers.common import HIGHEST, Linear, RMSNorm, logical, lora_adapter, lora_delta, param_dtype
from k3_jax.layers.parallel import axis_size
from k3_jax.parallel.expert import moe_dispatch_combine_ep
from k3_jax.quant.mxfp4 import fake_quant_mxfp4, pack_mxfp4
from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.moe import reference as moe_reference
from pallas_kernels.registry import target_platform
from sharding.local_kernels import per_shard

situ_glu = moe_reference.situ_glu


ROUTER_REDUCE_ROWS = 256
"""On GPU, up to this many tokens (decode) the router logits are an fp32 multiply + reduction over ``D`` (one
reduction fusion spread over the GPU) instead of an fp32 GEMM: with only 16..896 output columns and few rows,
XLA's HIGHEST-precision (FFMA) GEMM runs on a few thread blocks (~150 µs per K3-width layer at batch 64 on an
H200, more than the layer's KDA state update). Up to this many tokens the top-k expert selection ranks instead of
sorting too (:func:`select_experts`)."""


@jax.checkpoint
def _router_scores(x: jax.Array, router_kernel: jax.Array) -> jax.Array:
    """``sigmoid(f32(x) @ f32(W))`` in fp32 (HIGHEST precision); ``x [N, D]``, ``W [D, E]`` -> ``[N, E]`` f32.
    The backward re-widens ``x`` (no f32 copy is saved)."""
    x32, w32 = x.astype(jnp.float32), router_kernel.astype(jnp.float32)
    if x.ndim == 2 and x.shape[0] <= ROUTER_REDUCE_ROWS and target_platform() == "gpu":
        logits = jnp.sum(x32[:, :, None] * w32[None, :, :], axis=1)
    else:
        logits = jnp.matmul(x32, w32, precision=HIGHEST)
    return jax.nn.sigmoid(logits)


class SituMLP(nn.Module):
    """``down(SiTU-GLU(gate(x), up(x)))``; x [..., D] -> [..., D] (cfg.dtype). SiTU in fp32."""

    cfg: K3Config
    intermediate: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        gate = Linear(self.intermediate, ("embed", "mlp"), cfg, name="gate_proj")(x)
        up = Linear(self.intermediate, ("embed", "mlp"), cfg, name="up_proj")(x)
        act = situ_glu(gate, up, cfg.situ_beta, cfg.situ_linear_beta)
        return Linear(cfg.hidden_size, ("mlp", "embed"), cfg, name="down_proj")(act)


def float_order_keys(x: jax.Array) -> jax.Array:
    """``f32 [...]`` -> ``i32 [...]`` keys whose signed integer order is IEEE total order of the floats
    (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN), the order ``jax.lax.top_k`` ranks by."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def top_k_ids_by_rank(x: jax.Array, k: int, values: jax.Array | None = None):
    """``jax.lax.top_k(x, k)[1]`` computed by ranking instead of sorting: ``x [N, E]`` -> ``i32 [N, k]``; with
    ``values [N, E]``, also ``take_along_axis(values, ids, -1)`` from the same selection (one fused reduction on
    GPU, not a second kernel), returned as ``(ids, values at ids)``.

    Element ``i`` of a row has rank ``#{j : x_j > x_i} + #{j < i : x_j == x_i}`` in total order
    (:func:`float_order_keys`), so ranks are a permutation of ``0..E-1`` and ties go to the lower index, as in
    ``lax.top_k``; output position ``r`` holds the element of rank ``r``. Two reductions read the scores; the
    ``N·E²`` comparisons are fused, never materialised: meant for decode-sized ``N`` (XLA:GPU lowers ``top_k``
    over fewer than 1,024 columns to a sort, a multi-pass radix sort for ``N·E`` beyond a few thousand)."""
    n, e = x.shape
    if not 0 < k <= e:
        raise ValueError(f"top_k_ids_by_rank: k must be in [1, {e}] for scores of shape {x.shape}, got {k}")
    key = float_order_keys(x)
    idx = jnp.arange(e, dtype=jnp.int32)
    ki, kj = key[:, :, None], key[:, None, :]
    beats = (kj > ki) | ((kj == ki) & (idx[None, None, :] < idx[None, :, None]))  # [N, i, j]: j ranks above i
    rank = jnp.sum(beats.astype(jnp.int32), axis=-1)  # [N, E]
    hit = rank[:, None, :] == jnp.arange(k, dtype=jnp.int32)[None, :, None]  # [N, k, E]
    ids = jnp.sum(jnp.where(hit, idx[None, None, :], 0), axis=-1)
    if values is None:
        return ids
    return ids, jnp.sum(jnp.where(hit, values[:, None, :], jnp.zeros((), values.dtype)), axis=-1)


def select_experts(selection_scores: jax.Array, k: int) -> jax.Array:
    """The top-``k`` expert ids ``i32 [N, k]`` of ``selection_scores [N, E]`` f32, exactly
    ``jax.lax.top_k(selection_scores, k)[1]`` (same order, ties to the lower index). On GPU, up to
    :data:`ROUTER_REDUCE_ROWS` tokens (decode), by :func:`top_k_ids_by_rank` instead of XLA's sort."""
    if _rank_selection(selection_scores):
        return top_k_ids_by_rank(selection_scores, k)
    return jax.lax.top_k(selection_scores, k)[1].astype(jnp.int32)


def _rank_selection(selection_scores: jax.Array) -> bool:
    """Whether :func:`select_experts` ranks (decode-sized rows on GPU) instead of calling ``lax.top_k``."""
    return selection_scores.ndim == 2 and selection_scores.shape[0] <= ROUTER_REDUCE_ROWS and (
        target_platform() == "gpu")


def route(x: jax.Array, router_kernel: jax.Array, bias: jax.Array, k: int, renormalize: bool = True,
          scaling: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sigmoid router (fp32, HIGHEST precision).

    Args:
      x: ``[N, D]`` normalised tokens.  router_kernel: ``[D, E]``.  bias: ``[E]`` f32 correction bias.
    Returns:
      ``scores [N, E] f32`` (σ(x·W)), ``expert_ids [N, k] i32`` = top-k of ``scores + bias``,
      ``weights [N, k] f32`` = the selected *raw* scores, renormalised to sum 1 (+1e-20) and scaled.
      The bias enters only through the (integer) selection, so it receives no gradient.
    """
    scores = _router_scores(x, router_kernel)
    selection = jax.lax.stop_gradient(scores + bias.astype(jnp.float32))
    if _rank_selection(selection):  # the selected scores from the ranking's own reduction
        expert_ids, weights = top_k_ids_by_rank(selection, k, scores)
    else:
        expert_ids = select_experts(selection, k)
        weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return scores, expert_ids.astype(jnp.int32), weights * scaling


class Router(nn.Module):
    """``gate.kernel`` [D, E] and ``gate.e_score_correction_bias`` [E] f32 (names of the checkpoint)."""

    cfg: K3Config

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        kernel = self.param("kernel", logical(nn.initializers.normal(0.02), ("embed", "router_experts")),
                            (x.shape[-1], cfg.num_experts), param_dtype(cfg))
        bias = self.param("e_score_correction_bias", logical(nn.initializers.zeros, ("router_experts",)),
                          (cfg.num_experts,), jnp.float32)
        return route(x, kernel, bias, cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)


class RoutedExperts(nn.Module):
    """Expert weights, in the layout of ``cfg.expert_format``; returns them as the dict the MoE ops take.

    bf16: ``w1, w3 [E, L, I]``, ``w2 [E, I, L]`` ([in, out] per expert, logical ``experts/latent/expert_mlp``).
    mxfp4: ``w{1,3}.weight_packed u8 [E, I, L/2]`` + ``weight_scale u8 [E, I, L/32]``; ``w2`` the same over
    ``[E, L, I/…]`` (HF [out, in] orientation, as stored in the release).

    Returns ``(weights, adapters)``: ``weights`` the dict the MoE ops take, ``adapters`` the LoRA adapters the
    expert FFN must add on the activations (``{"w1": (a, b, scale), ...}``, see
    :data:`pallas_kernels.moe.reference.ExpertAdapters`) or None.

    bf16 weights with LoRA adapters ``{w}_lora_a/_lora_b/_lora_scale`` (see
    :func:`k3_jax.layers.common.lora_adapter`) are returned merged, ``w + scale · a @ b`` per expert (adapters
    None); with ``cfg.qat == "mxfp4"`` the (adapted) bf16 weights are returned fake-quantised to MXFP4
    (:func:`k3_jax.quant.mxfp4.fake_quant_mxfp4`, straight-through gradients). MXFP4 weights stay packed and
    frozen; their adapters are returned as they are, for the low-rank path beside the MXFP4 products
    (:func:`pallas_kernels.moe.ops.expert_ffn`).
    """

    cfg: K3Config

    @nn.compact
    def __call__(self) -> tuple[dict, dict | None]:
        cfg = self.cfg
        e, lat, im = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
        shapes = {"w1": (lat, im), "w3": (lat, im), "w2": (im, lat)}
        names = {"w1": ("experts", "latent", "expert_mlp"), "w3": ("experts", "latent", "expert_mlp"),
                 "w2": ("experts", "expert_mlp", "latent")}
        out: dict = {}
        adapters: dict = {}
        for w, (din, dout) in shapes.items():
            adapter = lora_adapter(self, f"{w}_")
            if cfg.expert_format == "bf16":
                weight = self.param(w, logical(nn.initializers.normal(0.02), names[w]), (e, din, dout),
                                    param_dtype(cfg))
                if adapter is not None:
                    weight = (weight.astype(jnp.float32) + lora_delta(*adapter)).astype(weight.dtype)
                out[w] = fake_quant_mxfp4(weight, -2) if cfg.qat == "mxfp4" else weight
            else:
                out[w] = PackedExpertWeight((e, dout, din), (names[w][0], names[w][2], names[w][1]),
                                            name=w)()
                if adapter is not None:
                    adapters[w] = adapter
        return out, (adapters or None)


class PackedExpertWeight(nn.Module):
    """MXFP4 expert weight ``{"weight_packed": u8 [E, out, in/2], "weight_scale": u8 [E, out, in/32]}``.

    Random init quantises a normal(0.02) dense weight (only used for synthetic models and shape inference).
    """

    shape: tuple[int, int, int]  # [E, out, in]
    names: tuple[str, str, str]

    @nn.compact
    def __call__(self) -> dict:
        e, dout, din = self.shape

        def dense(key):
            return jax.random.normal(key, (e, dout, din), jnp.float32) * 0.02

        packed = self.param("weight_packed", logical(lambda key, s, dt: pack_mxfp4(dense(key))[0], self.names),
                            (e, dout, din // 2), jnp.uint8)
        scale = self.param("weight_scale", logical(lambda key, s, dt: pack_mxfp4(dense(key))[1], self.names),
                           (e, dout, din // 32), jnp.uint8)
        return {"weight_packed": packed, "weight_scale": scale}


class LatentMoE(nn.Module):
    """Stable LatentMoE. ``x`` [B, T, D] (already ``post_attention_layernorm``-ed) -> [B, T, D].

    Sows ``intermediates/router_scores`` [B·T, E] f32 and ``intermediates/expert_ids`` [B·T, k] i32 for
    Quantile Balancing and load statistics.

    ``stacked_experts`` (one-token decode, see :func:`stacked_routed_experts`): this layer's ``experts`` params
    as the whole scanned segment's stack ``[R, ...]``, with ``layer`` (i32 scalar) its repeat; the expert kernel
    then reads the layer in place (no per-layer weight copy) instead of this scan step's slice.
    """

    cfg: K3Config

    @nn.compact
    def __call__(self, x: jax.Array, stacked_experts: dict | None = None,
                 layer: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        scores, expert_ids, weights = Router(cfg, name="gate")(flat)
        self.sow("intermediates", "router_scores", scores)
        self.sow("intermediates", "expert_ids", expert_ids)
        z = Linear(cfg.routed_expert_hidden_size, ("embed", "latent"), cfg, name="routed_expert_down_proj")(flat)
        strategy = expert_parallel_strategy(cfg)
        adapters = None
        if stacked_experts is not None and strategy is None:
            experts = stacked_experts
        else:
            (experts, adapters), layer = RoutedExperts(cfg, name="experts")(), None
        if strategy is not None:  # experts split over the `expert` mesh axis
            u = moe_dispatch_combine_ep(z, expert_ids, weights, experts, strategy=strategy,
                                        beta1=cfg.situ_beta, beta2=cfg.situ_linear_beta,
                                        ffn=_expert_ffn_kernel(cfg), adapters=adapters)
        else:  # kernels are single-device: each shard routes its own tokens through all experts
            def dispatch(z, expert_ids, weights, experts, adapters):
                return moe_ops.moe_dispatch_combine(
                    z, expert_ids, weights, experts, beta1=cfg.situ_beta, beta2=cfg.situ_linear_beta,
                    mxfp8_activations=cfg.qat == "mxfp4", implementation=cfg.moe_implementation,
                    platform=cfg.platform, layer=layer, adapters=adapters)

            tok = ("batch", None)
            u = per_shard(dispatch, (z, expert_ids, weights, experts, adapters), (tok, tok, tok, None, None),
                          (tok,))
        if cfg.latent_moe_use_norm:
            u = RMSNorm(cfg.rms_norm_eps, ("latent",), cfg.param_dtype, name="routed_expert_norm")(u)
        y = Linear(d, ("latent", "embed"), cfg, name="routed_expert_up_proj")(u)
        if cfg.num_shared_experts > 0:
            y = y + SituMLP(cfg, cfg.num_shared_experts * cfg.moe_intermediate_size, name="shared_experts")(flat)
        return y.reshape(b, t, d)


def stacked_routed_experts(cfg: K3Config, experts: dict | None) -> dict | None:
    """The ``experts`` params of a scanned MoE layer (stacks ``[R, ...]``) as the dict :class:`LatentMoE` takes
    for ``stacked_experts``, or None where :class:`RoutedExperts` must build the weights per layer (LoRA
    adapters, QAT fake quantisation) or there are none. Boxed (partitioned) leaves are unboxed."""
    if experts is None or cfg.qat == "mxfp4" or set(experts) != {"w1", "w2", "w3"}:
        return None
    return nn.meta.unbox(dict(experts))


def expert_parallel_strategy(cfg: K3Config) -> str | None:
    """``"allgather"`` | ``"all_to_all"`` | None (no expert parallelism) for ``cfg.moe_expert_parallel`` on the
    active mesh. ``"auto"``: all-gather "ring of experts" (suits top-16 routing) when the ``expert`` mesh axis has
    size > 1 and ``cfg.moe_implementation`` is not ``"xla"`` (explicitly the reference: XLA partitions the
    pure-JAX MoE instead); ``"none"``: never. An explicit strategy without an ``expert`` axis > 1 is None too."""
    mode = cfg.moe_expert_parallel
    if mode == "none" or axis_size("expert") <= 1:
        return None
    if mode == "auto":
        return None if moe_ops.EXPERT_FFN.canonical(cfg.moe_implementation) == "xla" else "allgather"
    return mode


def _expert_ffn_kernel(cfg: K3Config):
    """``ffn(x_sorted, group_sizes, w1, w3, w2, adapters=None)`` for expert parallelism:
    :func:`pallas_kernels.moe.ops.expert_ffn` with ``cfg.moe_implementation`` on ``cfg.platform``."""

    def ffn(x, group_sizes, w1, w3, w2, adapters=None):
        return moe_ops.expert_ffn(x, group_sizes, w1, w3, w2, beta1=cfg.situ_beta, beta2=cfg.situ_linear_beta,
                                  mxfp8_activations=cfg.qat == "mxfp4", implementation=cfg.moe_implementation,
                                  platform=cfg.platform, adapters=adapters)

    return ffn
