"""K3ForCausalLM: embedding → scanned layer segments → output AttnRes mix → norm → lm_head
(as the release's ``KimiLinearModel.forward``).

Depth is compiled per *segment*, not per layer: :func:`layer_plan` splits the layer sequence into runs of a
repeating group of layer kinds (for K3: layer 0, 22 × [KDA, KDA, MLA, KDA], 2 × KDA, 2 × MLA) and each run is
one ``nn.scan`` whose parameters carry a leading ``layers`` axis. Block Attention Residuals need no per-layer
Python control flow (see :mod:`k3_jax.layers.attn_res`), so the scan body is the same for every repeat.

Parameter tree (names follow the checkpoint)::

    params["model"]["embed_tokens"]["embedding"]                      [V, D]
    params["model"]["segment_{s}"]["layer_{j}"][...]                  [repeats, ...] per leaf
    params["model"]["output_attn_res_norm" | "output_attn_res_proj"]["weight"]   [D]
    params["model"]["norm"]["weight"]                                 [D]
    params["lm_head"]["kernel"]                                       [D, V]

Layer ``l = segment.start + r * segment.period + j`` lives at ``segment_{s}/layer_{j}`` index ``r``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.config import FfnKind, K3Config, MixerKind
from k3_jax.layers.attn_res import (
    attn_res_point,
    attn_sources_count,
    mlp_sources_count,
    num_sources,
    output_slot,
)
from k3_jax.layers.common import LinearKernel, RMSNorm, compute_dtype, einsum_f32, logical, param_dtype
from k3_jax.layers.kda import KimiDeltaAttention, stacked_decode_params
from k3_jax.layers.mla import KimiMLAAttention
from k3_jax.layers.moe import LatentMoE, SituMLP, stacked_routed_experts
from k3_jax.layers.parallel import axis_size, constrain
from k3_jax.parallel.vocab import vocab_parallel_embed
from pallas_kernels.registry import target_platform
from sharding.local_kernels import active_mesh_size

LayerKind = tuple[MixerKind, FfnKind]

FEATURES = "draft_features"
"""Opt-in collection: with ``mutable=[FEATURES]`` every layer sows ``residual`` [B, T, D] (cfg.dtype), the sum of
its AttnRes source slots after the layer (embedding + every sub-layer output so far, i.e. the plain residual
stream), stacked ``[repeats, ...]`` per segment; :mod:`k3_jax.draft` reads the layers a draft model fuses."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """``repeats`` consecutive copies of a group of ``period`` layers starting at layer ``start``."""

    start: int
    period: int
    repeats: int
    kinds: tuple[LayerKind, ...]

    def layer(self, repeat: int, position: int) -> int:
        return self.start + repeat * self.period + position

    @property
    def layers(self) -> range:
        return range(self.start, self.start + self.period * self.repeats)


def _greedy_plan(kinds: tuple[LayerKind, ...], period: int) -> list[Segment]:
    segments: list[Segment] = []
    i, n = 0, len(kinds)
    while i < n:
        pattern = kinds[i : i + period]
        reps = 0
        if len(pattern) == period:
            while kinds[i + reps * period : i + (reps + 1) * period] == pattern:
                reps += 1
        if reps >= 2:
            segments.append(Segment(i, period, reps, pattern))
            i += reps * period
            continue
        run = 1
        while i + run < n and kinds[i + run] == kinds[i]:
            run += 1
        segments.append(Segment(i, 1, run, (kinds[i],)))
        i += run
    return segments


def layer_plan(cfg: K3Config, max_period: int = 8) -> list[Segment]:
    """Split the layers into the fewest scanned segments (ties: the smaller period)."""
    kinds = cfg.layer_kinds()
    best: list[Segment] | None = None
    for period in range(1, max_period + 1):
        plan = _greedy_plan(kinds, period)
        if best is None or len(plan) < len(best):
            best = plan
    assert best is not None
    return best


class DecoderLayer(nn.Module):
    """One K3 layer. Updates the AttnRes source array ``[R, B, T, D]`` in place of a residual stream."""

    cfg: K3Config
    kind: LayerKind

    @nn.compact
    def __call__(self, sources: jax.Array, layer: jax.Array, segment_ids: jax.Array | None,
                 cache: dict | None, lengths: jax.Array | None,
                 cache_index: jax.Array | None = None,
                 stacked: dict | None = None,
                 page_table: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
        """``cache_index``: with a cache, ``cache`` is the segment's stacked entry ``[R, ...]`` and this
        layer reads and writes its repeat ``cache_index`` in place (see :class:`LayerGroup`);
        ``page_table`` (a paged cache): the MLA layers' page table ``[B, max_pages]``
        (:mod:`k3_jax.layers.paged_latent`);
        ``stacked`` (with ``cache_index``): this layer's entry of :func:`_segment_stacked_params`, the segment's
        stacked weights read at repeat ``cache_index`` in place (``"experts"``: see :class:`LatentMoE`;
        ``"kda"``: see :class:`KimiDeltaAttention`)."""
        cfg = self.cfg
        mixer_kind, ffn_kind = self.kind
        bs = cfg.attn_res_block_size
        pd = cfg.param_dtype
        slot = output_slot(layer, bs)

        h = attn_res_point(cfg, "self_attention_res", sources, attn_sources_count(layer, bs))
        h = RMSNorm(cfg.rms_norm_eps, ("embed",), pd, name="input_layernorm")(h)
        if mixer_kind == "kda":
            a, new_cache = KimiDeltaAttention(cfg, name="self_attn")(h, segment_ids, cache, cache_index,
                                                                      (stacked or {}).get("kda"))
        else:
            a, new_cache = KimiMLAAttention(cfg, name="self_attn")(h, segment_ids, cache, lengths, cache_index,
                                                                    page_table)
        sources = _add_to_slot(sources, slot, a)

        m = attn_res_point(cfg, "mlp_res", sources, mlp_sources_count(layer, bs))
        m = RMSNorm(cfg.rms_norm_eps, ("embed",), pd, name="post_attention_layernorm")(m)
        if ffn_kind == "dense":
            f = SituMLP(cfg, cfg.intermediate_size, name="mlp")(m)
        else:
            f = LatentMoE(cfg, name="block_sparse_moe")(m, (stacked or {}).get("experts"), cache_index)
        sources = _add_to_slot(sources, slot, f)
        if self.is_mutable_collection(FEATURES) and not self.is_initializing():  # init returns params only
            self.sow(FEATURES, "residual", jnp.sum(sources.astype(jnp.float32), axis=0).astype(sources.dtype))
        return constrain(sources, (None, "batch", "length", "embed")), new_cache


def _add_to_slot(sources: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    current = jax.lax.dynamic_index_in_dim(sources, slot, axis=0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(sources, (current + value).astype(sources.dtype), slot, 0)


_TRACE_KEYS = ("state_trace", "conv_trace")
"""Per-call outputs of a KDA cache entry (:func:`k3_jax.layers.kda.record_position_states`), not stacked state."""


class LayerGroup(nn.Module):
    """``period`` consecutive layers (one scan step of a :class:`Segment`), named ``layer_{j}``.

    ``in_place=False``: ``cache`` is this repeat's entries (scanned in, the new ones scanned out).
    ``in_place=True`` (any cached call on one device): the carry is ``(sources, stacked)`` with ``stacked`` the
    whole segment's cache ``[R, ...]``; each layer updates its repeat inside it (one-token KDA states through the
    decode kernel's state pool, other states, conv tails and the ``T`` new latents by dynamic-update-slice), so
    the donated cache buffers are updated in place and no per-repeat cache slice is copied in or stacked out.
    Returns ``((sources, stacked), traces)`` then: ``traces`` (scanned out, ``[R, ...]`` per leaf) holds the
    ``state_trace``/``conv_trace`` of the KDA layers under :func:`k3_jax.layers.kda.record_position_states`
    (``{layer_{j}: {...}}``), else None. ``stacked`` (broadcast, in place only): the segment's stacked weights
    that the layers read at this repeat instead of the scan step's slices (:func:`_segment_stacked_params`).
    """

    cfg: K3Config
    segment: Segment
    in_place: bool = False

    @nn.compact
    def __call__(self, sources: Any, repeat: jax.Array, cache: dict | None,
                 segment_ids: jax.Array | None, lengths: jax.Array | None,
                 stacked_params: dict | None = None, page_table: jax.Array | None = None
                 ) -> tuple[Any, dict | None]:
        stacked = None
        if self.in_place:
            sources, stacked = sources
        new_cache: dict | None = None if cache is None else {}
        layer_cls = _maybe_remat(DecoderLayer, self.cfg)
        traces: dict = {}
        for j, kind in enumerate(self.segment.kinds):
            layer = self.segment.start + repeat * self.segment.period + j
            if stacked is not None:
                weights = (stacked_params or {}).get(f"layer_{j}")
                cls = layer_cls
                if weights is not None and "small" in weights:
                    select = functools.partial(_small_params_at, weights["small"], repeat)
                    cls = nn.map_variables(layer_cls, "params", trans_in_fn=select, init=False, mutable=False)
                sources, entry = cls(self.cfg, kind, name=f"layer_{j}")(
                    sources, layer, segment_ids, stacked[f"layer_{j}"], lengths, repeat, weights, page_table)
                trace = {name: entry[name] for name in _TRACE_KEYS if name in entry}
                if trace:
                    traces[f"layer_{j}"] = trace
                stacked = {**stacked, f"layer_{j}": {n: v for n, v in entry.items() if n not in trace}}
                continue
            entry = None if cache is None else cache[f"layer_{j}"]
            sources, entry = layer_cls(self.cfg, kind, name=f"layer_{j}")(
                sources, layer, segment_ids, entry, lengths, None, None, page_table)
            if new_cache is not None:
                new_cache[f"layer_{j}"] = entry
        if stacked is not None:
            return (sources, stacked), traces or None
        return sources, new_cache


SMALL_PARAM_ELEMENTS = 65536
"""On GPU, per-layer parameter leaves up to this many elements (norm weights, AttnRes vectors, gate biases, conv
taps) are read from the segment's stack by :func:`select_repeat` in the in-place decode, not by the scan's slice
(elsewhere XLA fuses the slice into its consumers: the masked sum would only read the whole stack)."""


def select_repeat(stacked: jax.Array, repeat: jax.Array) -> jax.Array:
    """``stacked[repeat]`` as a masked sum over the stack's leading axis (exact: one row is kept, the others are
    zeros; a ``-0.0`` entry reads as ``+0.0``). XLA fuses it into the consumer, where on GPU the dynamic slice of a
    loop-invariant stack inside the layer scan is a launch of its own, per leaf and layer."""
    keep = (jnp.arange(stacked.shape[0]) == repeat).reshape(-1, *(1,) * (stacked.ndim - 1))
    return jnp.sum(jnp.where(keep, stacked, jnp.zeros((), stacked.dtype)), axis=0, dtype=stacked.dtype)


def _small_params_at(small: dict, repeat: jax.Array, variables: dict) -> dict:
    """``map_variables`` input transform: the layer's scan-sliced params with every leaf of ``small`` (the same
    paths, stacked ``[R, ...]``) replaced by :func:`select_repeat` of it (the slices left unused are dead code)."""
    def visit(sliced: Any, stack: Any) -> Any:
        if isinstance(sliced, dict):
            return {k: visit(v, stack.get(k)) if isinstance(stack, dict) else v for k, v in sliced.items()}
        return select_repeat(stack, repeat) if stack is not None else sliced

    return {**variables, "params": visit(dict(variables["params"]), small)}


def _maybe_remat(cls: type[nn.Module], cfg: K3Config) -> Any:
    if cfg.remat == "none":
        return cls
    policy = None if cfg.remat == "full" else jax.checkpoint_policies.checkpoint_dots
    return nn.remat(cls, policy=policy, prevent_cse=False)


class K3Model(nn.Module):
    """Embedding + layers + output AttnRes + final norm. tokens [B, T] i32 -> hidden [B, T, D] (cfg.dtype)."""

    cfg: K3Config

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 cache: dict | None = None, embeds_hook: Any = None) -> tuple[jax.Array, dict | None]:
        cfg = self.cfg
        dt = compute_dtype(cfg)
        b, t = tokens.shape
        embedding = self.param("embed_tokens", _embedding_init(cfg), cfg.vocab_size, cfg.hidden_size)
        if axis_size("tensor") > 1:  # rows of the table live on different devices: never gather it whole
            e = vocab_parallel_embed(tokens, embedding["embedding"]).astype(dt)
        else:  # ids outside [0, V) (negative ones too, which take would wrap) embed as NaN: see K3ForCausalLM
            safe = jnp.where(tokens < 0, cfg.vocab_size, tokens)
            e = jnp.take(embedding["embedding"], safe, axis=0, mode="fill", fill_value=jnp.nan).astype(dt)
        if embeds_hook is not None:  # [B, T, D] -> [B, T, D], e.g. media embeddings spliced in (k3_jax.multimodal)
            e = embeds_hook(e).astype(dt)
        sources = jnp.zeros((num_sources(cfg), b, t, cfg.hidden_size), dt).at[0].set(e)
        sources = constrain(sources, (None, "batch", "length", "embed"))
        lengths = None if cache is None else cache["lengths"]
        page_table = None if cache is None else cache.get("page_table")  # paged MLA pools (k3_jax.layers.paged_latent)

        # a cached call on one device: the stacked cache rides in the scan carry and is updated in place
        in_place = cache is not None and active_mesh_size() == 1
        new_segments = []
        for s, seg in enumerate(layer_plan(cfg)):
            scanned = nn.scan(
                LayerGroup,
                variable_axes={"params": 0, "intermediates": 0, FEATURES: 0},
                split_rngs={"params": True},
                in_axes=(0, 0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                length=seg.repeats,
                metadata_params={nn.PARTITION_NAME: "layers"},
                # The broadcast inputs (segment ids, lengths) are plain arguments, never derived from the carry:
                # skip flax's constancy re-trace (one trace per segment saved, and a forward-only kernel in the
                # body can never trip it; see pallas_kernels/forward_only.py).
                check_constancy_invariants=False,
            )
            seg_cache = None if cache is None else cache["segments"][s]
            if in_place:
                weights = None if self.is_initializing() else _segment_stacked_params(cfg, self.variables, s, seg)
                (sources, seg_new), traces = scanned(cfg, seg, in_place=True, name=f"segment_{s}")(
                    (sources, seg_cache), jnp.arange(seg.repeats), None, segment_ids, lengths, weights, page_table)
                seg_new = {name: {**e, **(traces or {}).get(name, {})} for name, e in seg_new.items()}
            else:
                sources, seg_new = scanned(cfg, seg, name=f"segment_{s}")(
                    sources, jnp.arange(seg.repeats), seg_cache, segment_ids, lengths, None, page_table)
            new_segments.append(seg_new)

        out = attn_res_point(cfg, "output_attn_res", sources, num_sources(cfg))
        hidden = RMSNorm(cfg.rms_norm_eps, ("embed",), cfg.param_dtype, name="norm")(out)
        new_cache = None
        if cache is not None:
            new_cache = {"lengths": cache["lengths"] + t, "segments": new_segments}
        return hidden, new_cache


def _segment_stacked_params(cfg: K3Config, variables: Any, s: int, seg: Segment) -> dict | None:
    """``{layer_{j}: {"experts": stacked routed-expert weights, "kda": stacked KDA decode parameters}}`` of segment
    ``s`` (each ``[R, ...]``, taken from the parameters as they are: no copy), for the one-token decode to read
    each repeat's in place (the expert kernel, :func:`k3_jax.layers.moe.stacked_routed_experts`; the KDA decode
    step, :func:`k3_jax.layers.kda.stacked_decode_params`), and on GPU ``"small"``: the small leaves of the
    layer's params (:func:`_small_leaves`, read by :func:`select_repeat`); entries that do not apply are left out,
    None when none do."""
    group = variables.get("params", {}).get(f"segment_{s}", {})
    out = {}
    for j, (mixer_kind, ffn_kind) in enumerate(seg.kinds):
        layer = group.get(f"layer_{j}", {})
        entry = {}
        if ffn_kind != "dense":
            experts = stacked_routed_experts(cfg, layer.get("block_sparse_moe", {}).get("experts"))
            if experts is not None:
                entry["experts"] = experts
        if mixer_kind == "kda" and cfg.short_conv_kernel_size > 1:
            kda = stacked_decode_params(layer.get("self_attn"))
            if kda is not None:
                entry["kda"] = kda
        small = _small_leaves(layer, seg.repeats) if target_platform(cfg.platform) == "gpu" else None
        if small:
            entry["small"] = small
        if entry:
            out[f"layer_{j}"] = entry
    return out or None


def _small_leaves(tree: dict, repeats: int) -> dict:
    """The leaves of a segment's stacked params ``tree`` of at most :data:`SMALL_PARAM_ELEMENTS` elements per repeat
    (arrays only; the nesting kept, empty branches dropped)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            sub = _small_leaves(v, repeats)
            if sub:
                out[k] = sub
        elif getattr(v, "ndim", 0) >= 1 and v.shape[0] == repeats and v.size // repeats <= SMALL_PARAM_ELEMENTS:
            out[k] = v
    return out


def _embedding_init(cfg: K3Config):
    def init(key, vocab: int, dim: int) -> dict:
        return {"embedding": logical(nn.initializers.normal(0.02), ("vocab", "embed"))(
            key, (vocab, dim), param_dtype(cfg))}

    return init


def check_token_ids(tokens: Any, vocab_size: int, name: str = "tokens") -> None:
    """Raise ``ValueError`` naming ``name``, the vocabulary range and the first bad ids when a concrete
    (host or fully addressable device) array of token ids holds an id outside ``[0, vocab_size)``.

    Does nothing for traced values (inside ``jit``) and for arrays spread over several processes.
    """
    if isinstance(tokens, jax.core.Tracer):
        return
    if isinstance(tokens, jax.Array) and not tokens.is_fully_addressable:
        return
    ids = np.asarray(tokens)
    if ids.size == 0:
        return
    if ids.dtype == object:  # Python ints beyond int64
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids.flat):
            raise ValueError(f"{name} must be integer token ids")
    elif not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name} must be integer token ids, got dtype {ids.dtype}")
    bad = np.asarray((ids < 0) | (ids >= vocab_size), bool)
    if bad.any():
        where = np.argwhere(bad)[:5]
        shown = ", ".join(f"{tuple(int(i) for i in w)}: {int(ids[tuple(w)])}" for w in where)
        raise ValueError(
            f"{name} has {int(bad.sum())} token id(s) outside the vocabulary [0, {vocab_size}); first at "
            f"(index: id) {shown}"
        )


def lm_head_logits(hidden: jax.Array, kernel: jax.Array) -> jax.Array:
    """``einsum_f32("btd,dv->btv", hidden, kernel)``: ``hidden [B, T, D]``, ``kernel [D, V]`` -> ``[B, T, V]`` f32.

    On GPU a product of one row (a one-token decode step at batch 1) with a low-precision weight is computed on
    two rows (the row and a row of zeros) and the first kept, behind an optimisation barrier: XLA:GPU runs a
    one-row bf16 × bf16 → f32 product as an f32 matrix-vector product over an f32 copy of the whole weight made on
    every call (three times the weight's bytes moved), two rows as the cuBLAS GEMM of larger batches (the
    weight read once).
    """
    b, t, _ = hidden.shape
    if b * t == 1 and kernel.dtype != jnp.float32 and target_platform() == "gpu":
        two = jnp.concatenate([hidden, jnp.zeros_like(hidden)], axis=0)
        return jax.lax.optimization_barrier(einsum_f32("btd,dv->btv", two, kernel))[:1]
    return einsum_f32("btd,dv->btv", hidden, kernel)


class K3ForCausalLM(nn.Module):
    """The K3 text model.

    ``apply(variables, tokens [B, T] i32, segment_ids=None) -> logits [B, T, V] f32``;
    ``return_hidden=True`` returns the final normalised hidden ``[B, T, D]`` instead (for chunked losses);
    with ``cache=`` (see :mod:`k3_jax.cache`) returns ``(logits_or_hidden, new_cache)``.
    ``segment_ids`` [B, T] marks packed documents: KDA state, short convs and MLA attention never cross them.

    Token ids must lie in ``[0, vocab_size)``. Concrete ``tokens`` (an eager ``apply``) are checked with
    :func:`check_token_ids`, which raises naming the bad ids. Traced ``tokens`` (under ``jit``) cannot be checked
    without a host sync: an out-of-range id (negative ones included) embeds as NaN, which makes the logits of its
    row NaN (attention multiplies masked positions by zero, so earlier positions too), never a silently wrapped
    or clamped row; callers that take untrusted ids check them first, as the serving engine does.
    ``embeds_hook`` (optional) maps the token embeddings ``[B, T, D]`` before the first layer.
    """

    cfg: K3Config

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, cache: dict | None = None,
                 return_hidden: bool = False, embeds_hook: Any = None) -> Any:
        cfg = self.cfg
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] int, got shape {tokens.shape}")
        check_token_ids(tokens, cfg.vocab_size)
        if segment_ids is not None and segment_ids.shape != tokens.shape:
            raise ValueError(f"segment_ids shape {segment_ids.shape} != tokens shape {tokens.shape}")
        if cache is not None and segment_ids is not None:
            raise ValueError("segment_ids are not supported together with a decode cache")
        hidden, new_cache = K3Model(cfg, name="model")(tokens, segment_ids, cache, embeds_hook)
        if return_hidden:
            out = hidden
        else:
            if cfg.tie_word_embeddings:
                kernel = self.variables["params"]["model"]["embed_tokens"]["embedding"].T
            else:
                kernel = LinearKernel(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), cfg, name="lm_head")()
            dt = compute_dtype(cfg)
            out = lm_head_logits(hidden.astype(dt), kernel.astype(dt))
        if cache is not None:
            return out, new_cache
        return out


def __getattr__(name: str) -> Any:  # K3ForConditionalGeneration (text + vision) lives in k3_jax.multimodal
    if name == "K3ForConditionalGeneration":
        from k3_jax.multimodal import K3ForConditionalGeneration  # noqa: PLC0415

        return K3ForConditionalGeneration
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
