"""Decoding engine: fixed decode slots, continuous batching, chunked prefill, one jitted decode step.

Slots are the batch rows of the model's decode cache (:func:`k3_jax.cache.init_cache`): per slot the KDA
states + conv tails of every KDA layer and the MLA latent of every MLA layer. A request is admitted into a
free slot (the slot's row is zeroed, then its prompt is prefilled in chunks), joins the running batch, and
leaves it when it finishes; nothing recompiles when requests come and go:

* prefill runs on the slot's row alone (``[1, T]``) in chunks of ``prefill_chunk`` tokens; the remainder is
  split into power-of-two pieces, so no padding token ever enters the KDA recurrence and at most
  ``log2(prefill_chunk) + 1`` prefill shapes are compiled;
* prefill is interleaved with decode: each :meth:`Engine.step` advances every prefilling request by up to
  ``prefill_chunk`` prompt tokens, then runs one decode step of the requests past their prefill, so a long
  prompt never stalls the others (its first token comes with its last piece);
* decode is one jitted function over all ``max_batch`` slots with the cache donated; idle and prefilling slots
  compute garbage that is discarded (their length is kept; the KDA rows of a prefilling slot are saved before
  the call and put back after it; an idle row is zeroed when a request arrives);
* with ``prefix_cache`` (paged only; :mod:`k3_jax.serving.prefix_cache`) an admitted request starts from the
  longest cached prefix of its prompt: the KDA snapshot is restored into its row, the full MLA pages are
  shared, the partial page is copied, and only the rest is prefilled; prefill pieces end on the snapshot
  endpoints, and the state after such a piece is stored as a new entry (no second prefill); so is the state
  after a decode step that reaches an endpoint (prompt + generated tokens: the next turn of a conversation
  reuses its reply; a multi-step decode block is cut to single steps up to the endpoint);
* sampling parameters are per-slot arrays (:mod:`k3_jax.serving.sampling`);
* engines of one layout (model config, cache axes, compute dtype, mesh and preset, XLA options) share their
  jitted functions, so a second engine of that layout in the process reuses the first one's compiled programs
  (:func:`shared_functions`); the functions hold no engine, only the layout.
* images (a vision model): a request's ``media`` (:class:`k3_jax.serving.media.RequestMedia`, its prompt holding
  one ``<|media_pad|>`` per media token) is encoded once, at its first prefill piece (not at all when a prefix-cache
  hit covers every item), and each prefill chunk splices the embeddings of its own pad positions into the token
  embeddings.

Failure isolation: every request is validated when it is added (:meth:`Engine.validate`: prompt ids in the
vocabulary, sampling values in their ranges). An unexpected exception while admitting or emitting one request
fails that request alone: it gets a final event with ``finish_reason="error"`` and ``error`` set, its slot is
freed, the traceback is logged with its id, and the others keep decoding. A failed decode call (all slots at
once) fails the running requests, rebuilds the cache if the call consumed it, and sets :attr:`Engine.degraded`
until a decode step succeeds again.

Python API::

    engine = Engine(cfg, params, max_batch=8, max_len=512)
    outs = engine.generate([[1, 5, 7], [1, 9]], max_new_tokens=16)        # greedy
    for ev in engine.generate_stream(prompts, max_new_tokens=16, temperature=0.8, seed=3):
        print(ev.request_id, ev.token, ev.text)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from k3_jax.cache import init_cache
from k3_jax.config import K3Config
from k3_jax.model import K3ForCausalLM, check_token_ids
from k3_jax.progress import prefill_progress
from k3_jax.serving import media as media_lib
from k3_jax.serving.chat import IncrementalDetokenizer
from k3_jax.serving.metrics import ServingMetrics
from k3_jax.serving.paged_cache import PageAllocator, PagedCacheSpec, gather_latent, write_latent
from k3_jax.serving.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixHit
from k3_jax.serving.sampling import SamplingArrays, SamplingParams, StopStrings, sample
from k3_jax.xla_flags import serving_compiler_options
from pallas_kernels.registry import target_platform
from sharding import rules

__all__ = ["Engine", "TokenEvent", "RequestError", "RequestFailed"]

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request cannot be served (empty/over-long prompt, bad token ids, bad sampling values)."""


class RequestFailed(RuntimeError):
    """A request failed while being served (an engine-side error, not a bad request)."""


@dataclasses.dataclass
class TokenEvent:
    """One generated token of one request (streaming unit)."""

    request_id: str
    index: int  # position in the request's output
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    text: str = ""  # text delta (empty without a tokenizer or while a stop string is undecided)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: str | None = None  # with finish_reason "error": what failed (the request's traceback is logged)


@dataclasses.dataclass
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    output: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1
    detok: IncrementalDetokenizer | None = None
    stops: StopStrings | None = None
    arrival: float = 0.0
    media: media_lib.RequestMedia | None = None  # images of the prompt (k3_jax.serving.media)
    pieces: list[tuple[int, bool]] = dataclasses.field(default_factory=list)  # prefill left: (tokens, snapshot after)
    pos: int = 0  # prompt tokens in the cache
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    progress: Any = None
    last_token_time: float = 0.0

    @property
    def prefilling(self) -> bool:
        return bool(self.pieces)


def _batch_axes(cfg: K3Config, max_len: int) -> Any:
    """Pytree of the batch axis of every cache leaf (found by comparing batch-1 and batch-2 shapes)."""
    one = jax.eval_shape(lambda: init_cache(cfg, 1, max_len))
    two = jax.eval_shape(lambda: init_cache(cfg, 2, max_len))

    def axis(a: jax.ShapeDtypeStruct, b: jax.ShapeDtypeStruct) -> int:
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y]
        if len(diff) != 1:
            raise ValueError(f"cannot find the batch axis of a cache leaf: {a.shape} vs {b.shape}")
        return diff[0]

    return jax.tree.map(axis, one, two)


def _prefill_pieces(n: int, chunk: int, mode: str = "pow2") -> list[int]:
    """Split ``n`` tokens into ``chunk``-sized pieces, then the remainder into power-of-two pieces
    (``mode="pow2"``: at most log2(chunk)+1 shapes) or single tokens (``mode="unit"``: 2 shapes)."""
    pieces = [chunk] * (n // chunk)
    rest = n % chunk
    if mode == "unit":
        return pieces + [1] * rest
    if mode != "pow2":
        raise ValueError(f"prefill mode must be 'pow2' or 'unit', got {mode!r}")
    bit = 1 << max(rest.bit_length() - 1, 0)
    while rest:
        if rest >= bit:
            pieces.append(bit)
            rest -= bit
        bit >>= 1
    return pieces


_SHARED_FUNCTIONS: collections.OrderedDict[Any, dict[str, Any]] = collections.OrderedDict()
SHARED_FUNCTION_SETS = 8
"""Most layouts whose jitted functions :func:`shared_functions` keeps (least recently built or used dropped)."""


def shared_functions(key: Any, build: Any) -> dict[str, Any]:
    """The jitted functions of layout ``key`` (hashable): ``build()`` (``-> {attribute name: function}``) the first
    time, the same objects (so the same compiled programs) after. ``build`` must not capture an engine: the set
    outlives the engine that built it."""
    fns = _SHARED_FUNCTIONS.get(key)
    if fns is None:
        fns = _SHARED_FUNCTIONS[key] = build()
        while len(_SHARED_FUNCTIONS) > SHARED_FUNCTION_SETS:
            _SHARED_FUNCTIONS.popitem(last=False)
    else:
        _SHARED_FUNCTIONS.move_to_end(key)
    return fns


def _frozen(tree: Any) -> Any:
    """A hashable copy of a tree of dicts / lists / tuples of hashable leaves (the cache axes)."""
    if isinstance(tree, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in tree.items()))
    if isinstance(tree, list | tuple):
        return tuple(_frozen(v) for v in tree)
    return tree


def _home_device(tree: Any) -> jax.Device:
    """The device of the first array of ``tree`` committed to one device, else the default device: where a
    one-device engine keeps its parameters and cache."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and x.committed and len(x.sharding.device_set) == 1:
            return next(iter(x.sharding.device_set))
    return jax.devices()[0]


def pin_to_cache_placement(mesh: Mesh | None, preset: str) -> Any:
    """``tree -> tree`` for traced functions: ``tree`` constrained to the placement :meth:`Engine._place` gives it on
    ``mesh`` (identity off a mesh), so a jitted function's outputs keep their inputs' layout (no recompile,
    donation in place)."""
    if mesh is None:
        return lambda tree: tree
    return lambda tree: jax.lax.with_sharding_constraint(tree, cache_shardings(tree, mesh, preset))


def jit_on_mesh(mesh: Mesh | None, preset: str) -> Any:
    """``(fn, pin=None, **jit_kwargs) -> jax.jit(fn, **jit_kwargs)``; on ``mesh``, ``fn`` is traced with the mesh
    and ``preset``'s rules active and ``pin`` (outputs -> outputs) applied to its outputs."""

    def jit(fn: Any, pin: Any = None, **kwargs: Any) -> Any:
        if mesh is None:
            return jax.jit(fn, **kwargs)

        @functools.wraps(fn)
        def pinned(*args: Any, **kw: Any) -> Any:
            out = fn(*args, **kw)
            return out if pin is None else pin(out)

        return jax.jit(rules.on_input_mesh(pinned, preset), **kwargs)

    return jit


class Engine:
    """Continuous-batching decoder over ``max_batch`` slots of up to ``max_len`` tokens each.

    Args:
      cfg: model config (its ``dtype`` is the compute dtype; use ``float32`` for exactness tests).
      params: the parameter tree (``params`` or ``{"params": params}``; boxed or plain).
      max_batch: decode slots.  max_len: tokens per slot (prompt + generated).
      prefill_chunk: prefill piece length (the KDA chunk size is a good choice).
      prefill_mode: how the prompt remainder below ``prefill_chunk`` is split: ``"pow2"`` (few calls, up to
        log2(chunk)+1 compiled shapes) or ``"unit"`` (one token per call, 2 compiled shapes in total).
      tokenizer: optional :class:`k3_jax.tokenizer.Tokenizer` for text deltas and stop strings.
      eos_ids: default stop token ids (default: ``cfg.eos_token_id``).
      max_logprobs: largest ``logprobs`` a request may ask for.
      cache_dtype: dtype of conv tails / MLA latents (default ``cfg.dtype``).
      page_size: tokens per MLA page when paged (default 16, or ``prefix_cache.page_size``).
      paged: keep the MLA latents in a shared page pool (:mod:`k3_jax.serving.paged_cache`) instead of
        ``max_batch × max_len`` rows: a request reserves ``ceil((prompt + max_tokens) / page_size)`` pages at
        admission and waits in the queue while the pool is short. Decode reads each slot's pages in place up to
        its length and writes the new token into its page (:mod:`k3_jax.layers.paged_latent`); a multi-token
        prefill piece runs on its row's view gathered from the pages.
      num_pages: page pool size (default: enough for every slot at ``max_len``, + the null page).
      latent_dtype: page storage dtype, e.g. ``"float8_e4m3fn"`` (per-token scales); default the cache dtype.
      prefix_cache: :class:`PrefixCacheConfig` (granularities + byte budgets) to reuse prompt prefixes; needs
        ``paged=True`` and sets ``page_size`` (default page pool: + ``mla_budget_bytes`` worth of pages).
      decode_block: decode steps per device call (multi-step decoding). With ``n > 1`` a step runs ``n`` decode
        steps in one jitted ``lax.scan`` (sampled tokens fed back on device) and the host reads the ``[n, B]``
        tokens once, so the per-step host work (dispatch, transfers, the sync on the sampled tokens) is paid
        once per ``n`` tokens. Tokens stream in bursts of ``n``; a block runs only when no waiting request could
        take a free slot and every running request has ``>= n`` tokens left, otherwise one step runs. A request
        that stops inside a block drops the rest of its block (its slot row is reset when reused), so outputs
        equal those of ``decode_block=1`` exactly.
      mesh: a :class:`jax.sharding.Mesh` (:func:`sharding.make_mesh`) to run the model sharded over, one process:
        the parameters are placed by their logical axis names under ``sharding_preset``'s rules, the cache is
        split by KDA heads and otherwise replicated (:func:`cache_shardings`), and every jitted function is traced
        with the mesh and rules active and keeps the cache's placement. None: one device.
      sharding_preset: the :mod:`sharding.rules` preset with ``mesh`` (default ``"serve"``).
    """

    def __init__(
        self,
        cfg: K3Config,
        params: Any,
        max_batch: int = 8,
        max_len: int = 512,
        page_size: int | None = None,
        prefill_chunk: int = 64,
        prefill_mode: str = "pow2",
        tokenizer: Any = None,
        eos_ids: Sequence[int] | None = None,
        max_logprobs: int = 5,
        cache_dtype: str | None = None,
        paged: bool = False,
        num_pages: int | None = None,
        latent_dtype: str | None = None,
        decode_block: int = 1,
        prefix_cache: PrefixCacheConfig | None = None,
        mesh: Mesh | None = None,
        sharding_preset: str = "serve",
    ):
        if max_batch < 1 or max_len < 2:
            raise ValueError(f"max_batch must be >= 1 and max_len >= 2, got {max_batch}, {max_len}")
        if prefill_chunk < 1 or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two, got {prefill_chunk}")
        if decode_block < 1:
            raise ValueError(f"decode_block must be >= 1, got {decode_block}")
        self.decode_block = decode_block
        if prefix_cache is not None:
            if not paged:
                raise ValueError("prefix_cache needs paged=True: cached MLA pages are shared through the page pool")
            if page_size is not None and page_size != prefix_cache.page_size:
                raise ValueError(f"page_size {page_size} != prefix_cache.page_size {prefix_cache.page_size}")
            page_size = prefix_cache.page_size
        page_size = 16 if page_size is None else page_size
        self.cfg = cfg
        self.max_batch, self.max_len, self.page_size = max_batch, max_len, page_size
        self.prefill_chunk = prefill_chunk
        _prefill_pieces(1, prefill_chunk, prefill_mode)  # validates the mode
        self.prefill_mode = prefill_mode
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs
        if eos_ids is None:
            eos_ids = () if cfg.eos_token_id is None else (cfg.eos_token_id,)
        self.eos_ids = tuple(eos_ids)
        params = nn.unbox(params)
        self.variables = params if "params" in params and "model" not in params else {"params": params}
        self.model = K3ForCausalLM(cfg)
        self.mesh, self.sharding_preset = mesh, sharding_preset
        if mesh is not None:
            self.variables = shard_variables(self.model, (jnp.zeros((1, 1), jnp.int32),), self.variables, mesh,
                                             sharding_preset)
        else:
            self._device = _home_device(self.variables)
            self.variables = self._place(self.variables)
        self._axes = _batch_axes(cfg, max_len)
        self._cache_dtype = cache_dtype
        self.cache = init_cache(cfg, max_batch, max_len, cache_dtype)
        self.paged = paged
        self._table = None
        self.compute_dtype = jnp.dtype(cache_dtype or cfg.dtype)
        self.platform = target_platform(cfg.platform)
        self.model_compiler_options = serving_compiler_options(self.platform) or None  # for the model steps' jits
        if paged:
            self.page_spec = PagedCacheSpec.from_config(
                cfg,
                max_batch,
                max_len,
                page_size,
                num_pages,
                latent_dtype=latent_dtype or str(self.compute_dtype),
                conv_dtype=str(self.compute_dtype),
            )
            if prefix_cache is not None and num_pages is None:  # room for the pages the cache may hold
                extra = prefix_cache.mla_budget_bytes // _page_bytes(self.page_spec)
                self.page_spec = dataclasses.replace(self.page_spec, num_pages=self.page_spec.num_pages + extra)
            self.cache, self._axes = self._to_paged(self.cache, self._axes)
            self.allocator = PageAllocator(self.page_spec)
            self._table = jnp.asarray(self.allocator.table)
        self.prefix: PrefixCache | None = None
        if prefix_cache is not None:
            self.prefix = PrefixCache(prefix_cache, self.allocator, _page_bytes(self.page_spec))
        self.cache = self._place(self.cache)
        self.metrics = ServingMetrics()
        self._build_fns()
        self._media_encoder: media_lib.MediaEncoder | None = None  # built at the first request with media
        # host state
        self._slots: list[_Request | None] = [None] * max_batch
        self._waiting: collections.deque[_Request] = collections.deque()
        self._by_id: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._samp = {
            "temperature": np.zeros(max_batch, np.float32),
            "top_k": np.zeros(max_batch, np.int32),
            "top_p": np.ones(max_batch, np.float32),
            "seed": np.zeros(max_batch, np.uint32),
        }
        self._last_token = np.zeros(max_batch, np.int32)
        self.stats = collections.Counter()
        self.step_failures = 0  # consecutive failed decode calls (0 after any successful one)
        self.last_step_error: str | None = None

    def _to_paged(self, cache: dict, axes: dict) -> tuple[dict, dict]:
        """Replace every MLA ``latent [R, B, L, D]`` entry by a page pool ``pages [R, P, S, D]`` + ``scale``."""
        spec = self.page_spec

        def entry(e: dict, ax: dict) -> tuple[dict, dict]:
            if "latent" not in e:
                return e, ax
            r = e["latent"].shape[0]
            pool = {
                "pages": jnp.zeros((r, spec.num_pages, spec.page_size, spec.latent_dim), spec.latent_dtype),
                "scale": jnp.ones((r, spec.num_pages, spec.page_size), jnp.float32),
            }
            return pool, {"pages": -1, "scale": -1}

        segs, seg_axes = [], []
        for seg, seg_ax in zip(cache["segments"], axes["segments"], strict=True):
            pairs = {k: entry(seg[k], seg_ax[k]) for k in seg}
            segs.append({k: v[0] for k, v in pairs.items()})
            seg_axes.append({k: v[1] for k, v in pairs.items()})
        return {**cache, "segments": segs}, {**axes, "segments": seg_axes}

    # ------------------------------------------------------------------ placement on a mesh
    def _place(self, cache: Any) -> Any:
        """``cache`` (or any tree of the engine's device state) placed on the mesh (:func:`cache_shardings`); off a
        mesh committed to the parameters' device (:func:`_home_device`), like the parameters: a jitted call's
        outputs are committed once any input is (restored parameters are), and jit compiles committed and
        uncommitted arguments apart, so a fresh uncommitted cache would compile every step twice (first call,
        then on its own outputs)."""
        if self.mesh is None:
            return jax.device_put(cache, jax.sharding.SingleDeviceSharding(self._device))
        return jax.device_put(cache, cache_shardings(cache, self.mesh, self.sharding_preset))

    # ------------------------------------------------------------------ jitted functions
    def _layout_key(self) -> tuple:
        """What the jitted functions depend on (:func:`shared_functions`): the model config, the cache axes,
        the compute dtype, the mesh and preset, and the model steps' XLA options."""
        opts = tuple(sorted((self.model_compiler_options or {}).items()))
        return (self.cfg, _frozen(self._axes), str(self.compute_dtype), self.mesh, self.sharding_preset, opts)

    def _build_fns(self) -> None:
        """Set the engine's jitted functions (``_prefill``, ``_decode``, ...), shared by engines of its layout."""
        for name, fn in shared_functions((Engine, self._layout_key()), self._engine_functions).items():
            setattr(self, name, fn)

    def _engine_functions(self) -> dict[str, Any]:
        """The engine's jitted functions; they capture the layout, never ``self``."""
        model, axes, cfg = self.model, self._axes, self.cfg
        jit = jit_on_mesh(self.mesh, self.sharding_preset)
        pin = pin_to_cache_placement(self.mesh, self.sharding_preset)

        take_row = functools.partial(take_cache_row, axes=axes)
        put_row = functools.partial(put_cache_row, axes=axes)

        cdt = self.compute_dtype

        def run(variables, cache, tokens, table, valid, hook=None, gather_view=False):
            """model.apply on a (possibly paged) cache; ``valid [B]``: rows whose new tokens are kept."""
            return apply_on_cache(model, variables, tokens, cache, table, cdt, valid, embeds_hook=hook,
                                  gather_view=gather_view)

        def reset(cache, slot):
            row = jax.tree.map(lambda x, ax: x if ax < 0 else jnp.zeros_like(x), take_row(cache, slot), axes)
            return put_row(cache, row, slot)

        def prefill(variables, cache, slot, tokens, table, media=None):
            """tokens [1, T] into slot ``slot`` (``media``: :func:`media_lib.chunk_media` rows + mask, or None);
            returns (logits of the last token [V] f32, cache)."""
            row = take_row(cache, slot)
            row_table = None if table is None else jax.lax.dynamic_slice_in_dim(table, slot, 1, 0)
            hook = media_lib.media_embeds_hook(media, tokens, cfg.pad_token_id)
            # a multi-token piece runs on the row's gathered view: the layer scan would pass every slot's pages
            # through the call (one token reads the pages in place, like decode)
            logits, row = run(variables, row, tokens, row_table, jnp.ones((1,), bool), hook, tokens.shape[1] > 1)
            return logits[0, -1].astype(jnp.float32), put_row(cache, row, slot)

        def decode(variables, cache, tokens, active, samp, num_top, table, sampling=True):
            """One decode step of every slot; ``sampling`` (static): see :func:`sample` (the host knows it)."""
            logits, new = run(variables, cache, tokens[:, None], table, active)
            # rows not decoded keep their length; the KDA rows of prefilling slots are restored by the host
            # (_decode_step), so no where() over every slot's state runs per step
            new = {**new, "lengths": jnp.where(active, new["lengths"], cache["lengths"])}
            return sample(logits[:, 0], samp, num_top_logprobs=num_top, sampling=sampling), new

        def decode_multi(variables, cache, tokens, active, samp, num_top, table, n, sampling=True):
            """``n`` decode steps, each feeding its sampled tokens to the next; outputs stacked ``[n, B, ...]``."""

            def body(carry, _):
                cache, toks, step = carry
                out, cache = decode(variables, cache, toks, active, samp._replace(step=step), num_top, table,
                                    sampling)
                return (cache, out.tokens, step + 1), out

            (cache, _, _), outs = jax.lax.scan(body, (cache, tokens, samp.step), None, length=n)
            return outs, cache

        def take_kda(cache, slot):
            """The KDA entries (state + conv of every KDA layer) of slot ``slot`` (batch 1): a snapshot (a copy)."""
            segs = take_row(cache, slot)["segments"]
            return [{k: e for k, e in seg.items() if "state" in e} for seg in segs]

        def put_kda(cache, snapshot, slot, length):
            """Restore a :func:`take_kda` snapshot into slot ``slot`` and set its length to ``length``."""
            row = take_row(cache, slot)
            segs = [{**seg, **snap} for seg, snap in zip(row["segments"], snapshot, strict=True)]
            row = {**row, "segments": segs, "lengths": jnp.full_like(row["lengths"], length)}
            return put_row(cache, row, slot)

        def copy_page(cache, src, dst):
            """Copy page ``src`` of every MLA pool to page ``dst`` (copy on write of a shared partial page)."""
            def entry(e):
                if "pages" not in e:
                    return e
                return {k: v.at[:, dst].set(v[:, src]) for k, v in e.items()}
            return {**cache, "segments": [{k: entry(v) for k, v in seg.items()} for seg in cache["segments"]]}

        pin_second = lambda out: (out[0], pin(out[1]))  # noqa: E731
        # the model steps: XLA options of serving on this platform (k3_jax.xla_flags.serving_compiler_options)
        opts = {"compiler_options": self.model_compiler_options}
        return {
            "_take_kda": jit(take_kda),
            "_put_kda": jit(put_kda, pin, donate_argnums=(0,)),
            "_copy_page": jit(copy_page, pin, donate_argnums=(0,)),
            "_reset": jit(reset, pin, donate_argnums=(0,)),
            "_decode_multi": jit(decode_multi, pin_second, donate_argnums=(1,), static_argnums=(5, 7, 8), **opts),
            "_prefill": jit(prefill, pin_second, donate_argnums=(1,), **opts),
            "_decode": jit(decode, pin_second, donate_argnums=(1,), static_argnums=(5, 7), **opts),
            "_sample": jit(sample, static_argnames=("num_top_logprobs", "sampling")),
        }

    # ------------------------------------------------------------------ request management
    def validate(self, prompt: Sequence[int], params: SamplingParams,
                 media: media_lib.RequestMedia | None = None) -> None:
        """Raise :class:`RequestError` naming what is wrong with a request (``media``: its images, whose
        ``<|media_pad|>`` positions the prompt holds, expanded)."""
        if len(prompt) == 0:
            raise RequestError("prompt is empty: at least one token is needed")
        if len(prompt) >= self.max_len:
            raise RequestError(
                f"prompt has {len(prompt)} tokens; this engine's max_len is {self.max_len} "
                f"(prompt + at least one generated token)"
            )
        try:
            check_token_ids(np.asarray(list(prompt)), self.cfg.vocab_size, name="prompt")
        except ValueError as e:
            raise RequestError(str(e)) from e
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        try:
            params.validate(self.cfg.vocab_size, self.max_logprobs)
        except ValueError as e:
            raise RequestError(str(e)) from e
        if self.paged:
            pages = -(-min(len(prompt) + params.max_tokens, self.max_len) // self.page_size)
            if pages > self.page_spec.num_pages - 1:
                raise RequestError(f"request needs {pages} cache pages; the pool has {self.page_spec.num_pages - 1}")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need an engine with a tokenizer")
        if media is not None:
            try:
                media_lib.check_request_media(prompt, media, self.cfg, "vision_tower" in self.variables["params"])
            except ValueError as e:
                raise RequestError(str(e)) from e

    def add_request(
        self, prompt: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None,
        media: media_lib.RequestMedia | None = None,
    ) -> str:
        """Queue a request; returns its id. ``max_tokens`` is capped at ``max_len - len(prompt)``."""
        params = params or SamplingParams()
        self.validate(prompt, params, media)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._by_id:
            raise RequestError(f"request id {rid!r} is already in use")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.eos_ids)
        req = _Request(
            id=rid,
            prompt=[int(t) for t in prompt],
            params=params,
            max_tokens=min(params.max_tokens, self.max_len - len(prompt)),
            stop_ids=frozenset(stop_ids),
            arrival=time.perf_counter(),
            media=media,
        )
        if self.tokenizer is not None:
            req.detok = IncrementalDetokenizer(self.tokenizer)
            req.stops = StopStrings(params.stop)
        self._waiting.append(req)
        self._by_id[rid] = req
        return rid

    def abort(self, request_id: str) -> None:
        """Drop a request (waiting or running); its slot is freed."""
        req = self._by_id.pop(request_id, None)
        if req is None:
            return
        if req.slot >= 0:
            self._free_slot(req.slot)
        else:
            self._waiting.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting) or any(r is not None for r in self._slots)

    @property
    def num_running(self) -> int:
        """Occupied decode slots."""
        return sum(r is not None for r in self._slots)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    @property
    def num_requests(self) -> int:
        """Requests the engine tracks (waiting + running); equals ``num_waiting + num_running`` unless leaked."""
        return len(self._by_id)

    @property
    def degraded(self) -> bool:
        """True while the last decode call failed (no decode step has succeeded since)."""
        return self.step_failures > 0

    # ------------------------------------------------------------------ stepping
    def _free_slot(self, slot: int) -> None:
        self._slots[slot] = None
        if self.paged:
            self.allocator.free(slot)
            self._table = jnp.asarray(self.allocator.table)

    def step(self) -> list[TokenEvent]:
        """Admit waiting requests into free slots, advance every prefilling request by up to ``prefill_chunk``
        prompt tokens (its first token comes with its last piece), then one decode step of the others."""
        events: list[TokenEvent] = []
        for slot in range(self.max_batch):
            if not self._waiting:
                break
            if self._slots[slot] is None:
                hit = self._reserve(slot, self._waiting[0])
                if hit is False:
                    break  # FIFO: wait until running requests return pages
                req = self._waiting.popleft()
                try:
                    self._start(req, slot, hit)
                except Exception as e:  # noqa: BLE001 - fail this request alone (see the module docstring)
                    events.append(self._fail(req, e))
                    if not self._cache_alive():
                        events += self._fail_running(e)
                finally:
                    if self.prefix is not None:
                        self.prefix.unpin(hit)
        for req in [r for r in self._slots if r is not None and r.prefilling]:
            try:
                events += self._prefill_some(req)
            except Exception as e:  # noqa: BLE001 - fail this request alone
                events.append(self._fail(req, e))
                if not self._cache_alive():
                    events += self._fail_running(e)
        if any(r is not None and not r.prefilling for r in self._slots):
            events += self._decode_step()
        return events

    def _reserve(self, slot: int, req: _Request) -> PrefixHit | None | bool:
        """Map the pages ``req`` needs into the free ``slot`` (shared prefix pages first). Returns the pinned
        prefix-cache hit (or None), or False when the pool is short (nothing changed)."""
        if not self.paged:
            return None
        need = len(req.prompt) + req.max_tokens
        hit = self.prefix.lookup(req.prompt, self._media_spans(req)) if self.prefix is not None else None
        shared = hit.shared_pages if hit is not None else []
        new_pages = -(-need // self.page_size) - len(shared)
        if self.prefix is not None and self.allocator.num_free < new_pages:
            self.prefix.evict_for_free_pages(new_pages)
        if self.allocator.num_free < new_pages:
            if self.prefix is not None:
                self.prefix.unpin(hit)
            self.stats["waits_for_pages"] += 1
            return False
        self.allocator.share(slot, shared)
        self.allocator.ensure(slot, need)
        self._table = jnp.asarray(self.allocator.table)
        return hit

    def _fail(self, req: _Request, exc: BaseException) -> TokenEvent:
        """End ``req`` with an error event; its slot (if any) is freed. The traceback is logged with its id."""
        logger.error("request %s failed: %s: %s", req.id, type(exc).__name__, exc, exc_info=exc)
        if req.slot >= 0 and self._slots[req.slot] is req:
            self._free_slot(req.slot)
        self._by_id.pop(req.id, None)
        self.stats["failed_requests"] += 1
        return TokenEvent(request_id=req.id, index=len(req.output), token=-1, finished=True,
                          finish_reason="error", error=f"{type(exc).__name__}: {exc}")

    def _fail_running(self, exc: BaseException) -> list[TokenEvent]:
        """Fail every running request (their device state is gone) and make the cache usable again."""
        events = [self._fail(r, exc) for r in list(self._slots) if r is not None]
        if not self._cache_alive():  # a failed call consumed its donated cache: start from a zero one
            cache = init_cache(self.cfg, self.max_batch, self.max_len, self._cache_dtype)
            if self.paged:
                cache, _ = self._to_paged(cache, _batch_axes(self.cfg, self.max_len))
            self.cache = self._place(cache)
            if self.prefix is not None:  # the pages the entries describe are zeros now
                self.prefix.clear()
        return events

    def _cache_alive(self) -> bool:
        return not any(x.is_deleted() for x in jax.tree.leaves(self.cache) if isinstance(x, jax.Array))

    def _start(self, req: _Request, slot: int, hit: PrefixHit | None) -> None:
        """Put ``req`` in ``slot``: reset the row, restore a prefix-cache hit (snapshot + copy of the partial
        page), and plan its prefill pieces (they end on every snapshot endpoint of the uncached part)."""
        req.slot = slot
        self._slots[slot] = req
        p = req.params
        self._samp["temperature"][slot] = p.temperature
        self._samp["top_k"][slot] = p.top_k
        self._samp["top_p"][slot] = p.top_p
        self._samp["seed"][slot] = np.uint32(p.seed)
        check_token_ids(np.asarray(req.prompt), self.cfg.vocab_size, name=f"prompt of request {req.id}")
        slot_arr = jnp.asarray(slot, jnp.int32)
        self.cache = self._reset(self.cache, slot_arr)
        n = len(req.prompt)
        if hit is not None:
            if hit.partial_page is not None:
                dst = self.allocator.owned[slot][len(hit.shared_pages)]
                self.cache = self._copy_page(self.cache, jnp.asarray(hit.partial_page, jnp.int32),
                                             jnp.asarray(dst, jnp.int32))
            self.cache = self._put_kda(self.cache, hit.snapshot, slot_arr, jnp.asarray(hit.end, jnp.int32))
            req.pos = req.cached_tokens = hit.end
        if self.prefix is not None:
            self.prefix.record(n, hit)
        bounds = self.prefix.endpoints(req.pos, n) if self.prefix is not None else []
        start = req.pos
        for end in [*bounds, n]:
            pieces = _prefill_pieces(end - start, self.prefill_chunk, self.prefill_mode) if end > start else []
            req.pieces += [(k, False) for k in pieces]
            if end in bounds and req.pieces:
                req.pieces[-1] = (req.pieces[-1][0], True)
            start = end
        req.progress = prefill_progress(n - req.pos, req.id)  # None unless the prompt is long

    def _prefill_some(self, req: _Request) -> list[TokenEvent]:
        """Run ``req``'s next prefill pieces, up to ``prefill_chunk`` tokens; snapshot the KDA state at the
        endpoints; after the last piece sample the first token."""
        prompt = np.asarray(req.prompt, np.int32)
        slot_arr = jnp.asarray(req.slot, jnp.int32)
        done, logits = 0, None
        embeds = self._encode_media(req.media, prompt[req.pos:])
        while req.pieces and done < self.prefill_chunk:
            n, snapshot = req.pieces.pop(0)
            toks = jnp.asarray(prompt[None, req.pos : req.pos + n])
            chunk = None if embeds is None else media_lib.chunk_media(
                prompt, embeds, req.pos, n, self.cfg.media_placeholder_token_id)
            logits, self.cache = self._prefill(self.variables, self.cache, slot_arr, toks, self._table, chunk)
            req.pos += n
            done += n
            if snapshot:
                self._snapshot(req)
            if req.progress is not None:
                req.progress.update(n, wait=logits)
        self.stats["prefill_tokens"] += done
        if req.pieces:
            return []
        samp = SamplingArrays.from_params([req.params], [0])
        out = jax.device_get(self._sample(logits[None], samp, num_top_logprobs=self.max_logprobs,
                                          sampling=req.params.temperature > 0))
        if req.progress is not None:
            req.progress.close()
        return [self._emit(req, int(out.tokens[0]), out, 0)]

    def _encode_media(self, media: media_lib.RequestMedia | None, rest: np.ndarray) -> np.ndarray | None:
        """The request's media embeddings (the vision encoder runs once per request, at its first prefill piece).
        When ``rest`` (the prompt still to prefill) holds no ``<|media_pad|>`` (a prefix-cache hit covered every
        item), the encoder is skipped: an empty ``[0, D]`` array stands in, so the chunks still zero the
        ``pad_token_id`` positions of a media request."""
        if media is None:
            return None
        if media.embeds is None and not np.any(rest == self.cfg.media_placeholder_token_id):
            return np.zeros((0, self.cfg.hidden_size), np.float32)
        if media.embeds is None:
            if self._media_encoder is None:
                self._media_encoder = media_lib.MediaEncoder(self.cfg, self.variables)
            media.embeds = self._media_encoder(media)
        return media.embeds

    def _snapshot(self, req: _Request, tokens: Sequence[int] | None = None, end: int | None = None) -> None:
        """Store the prefix-cache entry of ``tokens[:end]`` (an endpoint; default the prompt up to ``req.pos``),
        which ``req``'s slot holds now: KDA snapshot + its pages."""
        tokens = req.prompt if tokens is None else tokens
        end = req.pos if end is None else end
        media = self._media_spans(req)
        if self.prefix.has_entry(tokens, end, media):
            return
        snap = self._take_kda(self.cache, jnp.asarray(req.slot, jnp.int32))
        nbytes = sum(x.nbytes for x in jax.tree.leaves(snap))
        self.prefix.insert(tokens, end, self.allocator.owned[req.slot], snap, nbytes, media)

    def _snapshot_decoded(self, active: np.ndarray) -> None:
        """After a one-step decode call: a decoding request whose cache now holds a stride endpoint's worth of
        tokens (prompt + every token generated so far, the last one fed by this call) stores that entry, so a
        later prompt that repeats the generated tokens (the next turn of a conversation) reuses them too."""
        stride = self.prefix.config.stride
        for slot, req in enumerate(self._slots):
            if active[slot] and req is not None:
                end = len(req.prompt) + len(req.output)
                if end % stride == 0:
                    self._snapshot(req, req.prompt + req.output, end)

    def _media_spans(self, req: _Request) -> tuple:
        """The spans by which ``req``'s embeddings differ from its token ids' (media items, zeroed
        ``pad_token_id`` positions): part of its prefix identity (:func:`k3_jax.serving.media.prefix_media_spans`)."""
        return media_lib.prefix_media_spans(req.prompt, req.media, self.cfg.media_placeholder_token_id,
                                            self.cfg.pad_token_id)

    def _block_size(self) -> int:
        """Decode steps of the next device call: ``decode_block`` when no admission is pending and every running
        request has that many tokens left, else 1."""
        n = self.decode_block
        if n == 1 or (self._waiting and any(r is None for r in self._slots)):
            return 1
        if any(r is not None and r.prefilling for r in self._slots):
            return 1
        if self.prefix is not None and any(self._endpoint_within(r, n) for r in self._slots if r is not None):
            return 1  # single steps up to the endpoint: its snapshot is taken after a one-step call
        left = min(r.max_tokens - len(r.output) for r in self._slots if r is not None)
        return n if left >= n else 1

    def _endpoint_within(self, req: _Request, n: int) -> bool:
        """True when ``n`` decode steps of ``req`` would reach a snapshot endpoint (its cache holds prompt +
        output minus the last token before them)."""
        held, stride = len(req.prompt) + len(req.output) - 1, self.prefix.config.stride
        return (held + n) // stride > held // stride

    def _decode_step(self) -> list[TokenEvent]:
        active = np.asarray([r is not None and not r.prefilling for r in self._slots])
        steps = np.asarray([len(r.output) if r is not None else 0 for r in self._slots], np.int32)
        samp = SamplingArrays(
            temperature=jnp.asarray(self._samp["temperature"]),
            top_k=jnp.asarray(self._samp["top_k"]),
            top_p=jnp.asarray(self._samp["top_p"]),
            seed=jnp.asarray(self._samp["seed"]),
            step=jnp.asarray(steps),
        )
        n = self._block_size()
        saved = self._save_prefilling_rows()
        try:
            args = (self.variables, self.cache, jnp.asarray(self._last_token), jnp.asarray(active), samp,
                    self.max_logprobs, self._table)  # max_logprobs: always computed, one compiled decode step
            # static: all-greedy batches run a program without the sampling sort
            sampling = bool(np.any(self._samp["temperature"][active] > 0))
            if n == 1:
                out, self.cache = self._decode(*args, sampling=sampling)
                outs = [jax.device_get(out)]
            else:
                stacked, self.cache = self._decode_multi(*args, n, sampling=sampling)
                stacked = jax.device_get(stacked)
                outs = [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n)]
            self._restore_prefilling_rows(saved)
        except Exception as e:  # noqa: BLE001 - the batch's state is lost: fail its requests, keep the engine
            self.step_failures += 1
            self.last_step_error = f"{type(e).__name__}: {e}"
            logger.error("decode step failed (%d in a row); failing the running requests", self.step_failures)
            return self._fail_running(e)
        self.step_failures = 0
        self.last_step_error = None
        if self.prefix is not None and n == 1:
            self._snapshot_decoded(active)
        self.stats["decode_steps"] += n
        events = []
        for out in outs:
            for slot, req in enumerate(self._slots):
                if active[slot] and req is not None:  # a request that finished earlier in this block has left
                    try:
                        events.append(self._emit(req, int(out.tokens[slot]), out, slot))
                    except Exception as e:  # noqa: BLE001 - this request alone fails
                        events.append(self._fail(req, e))
                    self.stats["decode_tokens"] += 1
        return events

    def _save_prefilling_rows(self) -> list[tuple[jax.Array, int, Any]]:
        """``(slot, prompt tokens in the cache, KDA rows)`` of every request still prefilling: a decode call
        writes every row, so these are put back after it (:meth:`_restore_prefilling_rows`)."""
        return [(jnp.asarray(slot, jnp.int32), r.pos, self._take_kda(self.cache, jnp.asarray(slot, jnp.int32)))
                for slot, r in enumerate(self._slots) if r is not None and r.prefilling]

    def _restore_prefilling_rows(self, saved: list[tuple[jax.Array, int, Any]]) -> None:
        for slot, pos, snap in saved:
            self.cache = self._put_kda(self.cache, snap, slot, jnp.asarray(pos, jnp.int32))

    def _emit(self, req: _Request, token: int, out: Any, row: int) -> TokenEvent:
        p = req.params
        ev = TokenEvent(request_id=req.id, index=len(req.output), token=token)
        if p.logprobs is not None:
            ev.logprob = float(out.logprob[row])
            if p.logprobs:
                ev.top_logprobs = [
                    (int(i), float(v))
                    for i, v in zip(out.top_ids[row][: p.logprobs], out.top_logprobs[row][: p.logprobs], strict=True)
                ]
        req.output.append(token)
        self._last_token[req.slot] = token
        req.last_token_time = self.metrics.token(req.arrival, req.last_token_time)
        if token in req.stop_ids:
            ev.finished, ev.finish_reason = True, "stop"
        elif req.detok is not None:
            text, stopped = req.stops.push(req.detok.push(token))
            ev.text = text
            if stopped:
                ev.finished, ev.finish_reason = True, "stop"
        if not ev.finished and len(req.output) >= req.max_tokens:
            ev.finished, ev.finish_reason = True, "length"
        if ev.finished:
            if req.detok is not None:  # whatever the reason, emit the held-back text (empty after a stop string)
                ev.text += req.stops.push(req.detok.flush())[0] + req.stops.flush()
            self._free_slot(req.slot)
            self._by_id.pop(req.id, None)
        return ev

    # ------------------------------------------------------------------ convenience API
    def _params_list(
        self,
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
        stop_token_ids: Sequence[int] | None,
        **extra: Any,
    ) -> list[SamplingParams]:
        out = []
        for i in range(n):
            kw = dict(
                max_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=(seed + i) % (2**32),
                **extra,
            )
            if stop_token_ids is not None:
                kw.update(stop_token_ids=tuple(stop_token_ids), ignore_eos=True)
            out.append(SamplingParams(**kw))
        return out

    def generate_stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        **extra: Any,
    ) -> Iterator[TokenEvent]:
        """Yield :class:`TokenEvent` s as they are produced; request ``i`` has id ``"gen-{i}"`` and seed
        ``seed + i``. ``stop_token_ids=None`` stops at eos; a sequence replaces eos by those ids.
        Raises :class:`RequestFailed` (after aborting the others) when one of the requests fails."""
        params = self._params_list(
            len(prompts), max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, **extra
        )
        for prompt, p in zip(prompts, params, strict=True):
            self.validate(prompt, p)  # all or nothing
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            ids.append(self.add_request(prompt, p, request_id=f"gen-{i}-{next(self._ids)}"))
        pending = set(ids)
        rename = {rid: f"gen-{i}" for i, rid in enumerate(ids)}
        try:
            while pending:
                for ev in self.step():
                    if ev.request_id in pending:
                        if ev.finished:
                            pending.discard(ev.request_id)
                        if ev.finish_reason == "error":
                            raise RequestFailed(f"request {rename[ev.request_id]} failed: {ev.error}")
                        ev.request_id = rename[ev.request_id]
                        yield ev
        finally:
            for rid in pending:
                self.abort(rid)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        **extra: Any,
    ) -> list[list[int]]:
        """Generated token ids per prompt (the stop token, when hit, is included)."""
        outs: list[list[int]] = [[] for _ in prompts]
        for ev in self.generate_stream(
            prompts, max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, **extra
        ):
            outs[int(ev.request_id.split("-")[1])].append(ev.token)
        return outs


def take_cache_row(cache: Any, slot: jax.Array, axes: Any) -> Any:
    """Row ``slot`` (batch 1) of every cache leaf along its batch axis in ``axes``; a leaf whose axis is -1 (shared
    by all slots: the page pool) is returned whole."""
    return jax.tree.map(lambda x, ax: x if ax < 0 else jax.lax.dynamic_slice_in_dim(x, slot, 1, ax), cache, axes)


def put_cache_row(cache: Any, row: Any, slot: jax.Array, axes: Any) -> Any:
    """``cache`` with row ``slot`` replaced by ``row`` (a :func:`take_cache_row` tree); shared leaves (axis -1)
    are replaced whole."""
    return jax.tree.map(
        lambda x, r, ax: r.astype(x.dtype) if ax < 0 else jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype),
                                                                                               slot, ax),
        cache, row, axes)


def apply_on_cache(model: nn.Module, variables: Any, tokens: jax.Array, cache: dict, table: jax.Array | None,
                   dtype: Any, valid: jax.Array, mutable: Any = False, gather_view: bool = False,
                   **kwargs: Any) -> Any:
    """``model.apply(variables, tokens [B, T], cache=...)`` on a contiguous (``table`` None) or paged cache.

    Paged (``table [B, max_pages]``): the MLA layers read each row's pages in place through the table and write the
    ``T`` new tokens at each row's ``lengths`` straight into its pages (:mod:`k3_jax.layers.paged_latent`); rows
    with ``valid [B]`` False see an all-null table row (their tokens go to the null page, they read nothing, their
    outputs are garbage to discard). ``gather_view=True`` (a one-row prefill: the layer scan would otherwise pass
    every slot's pool through each call) runs the model on the row's contiguous view gathered through ``table``
    (``dtype``) and writes the new tokens back into its pages. Returns what ``model.apply`` returns (``((logits,
    cache), collections)`` with ``mutable``), with the paged cache."""
    if table is None:
        return model.apply(variables, tokens, cache=cache, mutable=mutable, **kwargs)
    if not gather_view:
        paged = {**cache, "page_table": jnp.where(valid[:, None], table, 0)}
        return model.apply(variables, tokens, cache=paged, mutable=mutable, **kwargs)
    out = model.apply(variables, tokens, cache=_gather_view(cache, table, dtype), mutable=mutable, **kwargs)
    (logits, new), rest = (out, None) if mutable is False else out
    new = _absorb(cache, new, table, cache["lengths"], tokens.shape[1], valid)
    return (logits, new) if mutable is False else ((logits, new), rest)


def _gather_view(cache: dict, table: jax.Array, dtype: Any) -> dict:
    """The model's contiguous cache view of a paged cache: each MLA pool -> ``latent [R, B, maxp·S, D]``."""

    def entry(e: dict) -> dict:
        if "pages" not in e:
            return e
        lat = jax.vmap(lambda p, sc: gather_latent(p, sc, table, dtype))(e["pages"], e["scale"])
        return {"latent": lat}

    return {**cache, "segments": [{k: entry(v) for k, v in seg.items()} for seg in cache["segments"]]}


def _absorb(paged: dict, new: dict, table: jax.Array, start: jax.Array, t: int, valid: jax.Array) -> dict:
    """Write the ``t`` tokens the model appended at ``start [B]`` of each MLA view back into the pages
    (rows with ``valid [B]`` False go to the null page); KDA entries and lengths come from ``new``."""
    positions = start[:, None] + jnp.arange(t, dtype=start.dtype)[None, :]  # [B, T]
    keep = jnp.broadcast_to(valid[:, None], positions.shape)

    def entry(old: dict, fresh: dict) -> dict:
        if "pages" not in old:
            return fresh
        vals = jnp.take_along_axis(fresh["latent"], positions[None, :, :, None], axis=2)  # [R, B, T, D]
        pages, scale = jax.vmap(lambda p, sc, v: write_latent(p, sc, table, positions, v, keep))(
            old["pages"], old["scale"], vals
        )
        return {"pages": pages, "scale": scale}

    segs = [{k: entry(o[k], f[k]) for k in o} for o, f in zip(paged["segments"], new["segments"], strict=True)]
    return {**new, "segments": segs}


def _page_bytes(spec: PagedCacheSpec) -> int:
    """Bytes of one page over all MLA pools (latent values + the f32 per-token scales)."""
    item = jnp.dtype(spec.latent_dtype).itemsize
    return spec.num_mla_layers * spec.page_size * (spec.latent_dim * item + 4)


def cache_shardings(tree: Any, mesh: Mesh, preset: str) -> Any:
    """Placement of a decode-cache tree on ``mesh``: every KDA ``state`` leaf (``[..., H, K, V]``) split over the
    axes ``preset`` gives ``kda_heads`` (where they divide ``H``), every other leaf replicated."""

    def one(path: Any, x: Any) -> NamedSharding:
        names: list[str | None] = [None] * x.ndim
        key = path[-1] if path else None
        if getattr(key, "key", None) == "state" and x.ndim >= 3:
            names[x.ndim - 3] = "kda_heads"
        return NamedSharding(mesh, rules.logical_to_pspec(names, preset, mesh, shape=x.shape))

    return jax.tree_util.tree_map_with_path(one, tree)


def shard_variables(module: nn.Module, init_args: Sequence[Any], variables: Any, mesh: Mesh, preset: str) -> Any:
    """``variables`` placed on ``mesh`` by the logical axis names of ``module``'s parameters (from
    ``module.init(key, *init_args)`` traced abstractly) under ``preset``'s rules."""
    abstract = jax.eval_shape(functools.partial(module.init, jax.random.PRNGKey(0)), *init_args)
    shardings = rules.param_shardings(abstract, mesh, preset)
    want, got = jax.tree_util.tree_structure(shardings), jax.tree_util.tree_structure(variables)
    if want != got:
        raise ValueError(f"{type(module).__name__} variables do not match the module's parameters "
                         f"({got.num_leaves} leaves vs {want.num_leaves}): cannot place them on the mesh")
    return jax.device_put(variables, shardings)
