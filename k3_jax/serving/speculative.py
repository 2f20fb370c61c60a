"""Speculative decoding: an EAGLE-3 style draft (:mod:`k3_jax.draft`) proposes ``k`` tokens per row, the target
verifies them in one batched forward over ``k + 1`` positions, and a lossless rule keeps a prefix.

One decode round (:func:`speculative_round`, one jitted call for all slots):

1. **Draft catch-up + first draft.** The draft consumes the (target feature, token) pairs the target produced
   since the last round (``1 .. k + 1`` per row, padded to ``k + 1``) and drafts ``d_1`` from its output at the
   last real pair. Its cache keeps exactly those pairs: an MLA draft by its ``lengths`` (padding entries lie
   beyond them and are overwritten later), a KDA draft by the per-position state trace.
2. **Chain.** ``k - 1`` more one-token draft steps, each fed the draft's own hidden state and its last token.
   The chain's cache writes are dropped (step 1's committed draft cache is returned).
3. **Verify.** The target runs once over ``[last token, d_1 .. d_k]`` (``T = k + 1``) with the opt-in residual
   features and KDA position traces (:func:`k3_jax.layers.kda.record_position_states`). On one device it runs as
   the decode step does (:class:`k3_jax.model.LayerGroup`, ``in_place``): the stacked cache rides in the layer
   scan's carry, the ``k + 1`` latents are written into it at each row's length, the KDA states and conv tails are
   left untouched (the traces come out as the scan's stacked outputs), and the expert kernel reads the stacked
   expert weights, so no cache or weight slice is copied per layer.
4. **Accept** (:func:`speculative_accept`): greedy rows keep drafts while they equal the target's argmax; sampled
   rows keep ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))`` and at the first rejection draw from the
   residual ``max(p_i - q_i, 0)``; after ``n`` accepted drafts the row emits ``d_1 .. d_n`` and one more token
   (the correction, or a bonus draw from ``p_n`` when all ``k_b`` drafts were kept). ``p``/``q`` are the target's
   and the draft's *sampling* distributions (temperature, top-k, top-p applied), so each emitted token has
   exactly the distribution plain sampling gives. A round whose rows are all greedy (static ``sampling=False``)
   compares argmaxes (:func:`greedy_accept`) instead, with the same result.
5. **Rollback.** The target cache keeps ``n + 1`` of the ``k + 1`` verified tokens per row: MLA latents by setting
   ``lengths`` (entries past it, in the row or in its pages, are masked and overwritten later), KDA by taking
   the state the verify pass recorded after token ``n`` and the conv tail at that position (written over the
   donated state and conv buffers, which the verify pass left as they were). Keeping the
   per-position states (not restoring the pre-verify state and recomputing the accepted prefix) costs ``k + 1``
   KDA states per row of device memory during the verify call but no second target forward, and rows with
   different acceptance need no per-row-length recompute; the verify pass runs the recurrent form over the
   ``k + 1`` tokens with the decode step's arithmetic per token, one kernel call per KDA layer on a GPU
   (:mod:`pallas_kernels.kda.verify`).

Per-request draft length: ``k_b <= k`` per row (drafts past ``k_b`` are ignored); rows accept independently.

Several rounds per device call (:func:`speculative_rounds`, the engine's ``decode_block``): the rounds run in one
``lax.scan`` with the bookkeeping on the device (each round's last token, sampling step and tokens left per row
feed the next round; a row stops when it has no tokens left), so the host syncs once per ``n`` rounds; the
outputs are those of ``n`` single rounds.
Randomness: the keys of a row come from ``fold_in(key(seed), step)`` (``step`` = tokens generated so far), so
a request's draws do not depend on its batch row or its neighbours.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.config import K3Config
from k3_jax.draft import (
    HEAD_AXES,
    DraftConfig,
    DraftModel,
    check_draft_params,
    draft_head,
    head_variables,
    init_draft_cache,
    target_features,
    unbox_params,
)
from k3_jax.layers.kda import record_position_states
from k3_jax.model import FEATURES, K3ForCausalLM
from k3_jax.serving import media as media_lib
from k3_jax.serving.engine import (
    Engine,
    RequestError,
    _prefill_pieces,
    apply_on_cache,
    jit_on_mesh,
    pin_to_cache_placement,
    put_cache_row,
    shard_variables,
    shared_functions,
    take_cache_row,
)
from k3_jax.serving.sampling import (
    SampleOutput,
    SamplingArrays,
    SamplingParams,
    _filtered_sorted_logits,
    top_k_in_chunks,
)
from sharding import rules

__all__ = ["SpeculativeEngine", "speculative_accept", "speculative_rounds", "sampling_probs", "greedy_accept",
           "RoundOutput", "SpecStats"]

_TAG_DRAFT, _TAG_ACCEPT, _TAG_NEXT = 1, 2, 3


def sampling_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The distribution :func:`k3_jax.serving.sampling.sample` draws from, ``[B, T, V]`` f32 for ``logits
    [B, T, V]`` and per-row ``[B]`` parameters: temperature / top-k / top-p applied, one-hot argmax where
    ``temperature == 0``."""
    logits = logits.astype(jnp.float32)
    b, t, v = logits.shape

    def one(lg: jax.Array) -> jax.Array:  # [B, V]
        masked, order = _filtered_sorted_logits(lg, temperature, top_k, top_p)
        probs_sorted = jax.nn.softmax(masked, axis=-1)
        probs = jnp.zeros_like(probs_sorted).at[jnp.arange(b)[:, None], order].set(probs_sorted)
        greedy = jax.nn.one_hot(jnp.argmax(lg, axis=-1), v, dtype=jnp.float32)
        return jnp.where((temperature > 0)[:, None], probs, greedy)

    return jax.vmap(one, in_axes=1, out_axes=1)(logits)


def greedy_accept(target_argmax: jax.Array, drafts: jax.Array, num_drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`speculative_accept` for rows that are all greedy, without distributions or random draws.

    ``target_argmax [B, K+1]`` i32 (the target's argmax at each verified position), ``drafts [B, K]`` (each the
    draft's argmax), ``num_drafts [B]`` in ``[0, K]``. Returns ``(accepted [B], next_token [B])``: drafts are
    kept while they equal the target's argmax, then the target's argmax at the first position not kept, which is
    what :func:`speculative_accept` gives for one-hot ``p`` and ``q``."""
    k = drafts.shape[1]
    ok = (drafts == target_argmax[:, :k]) & (jnp.arange(k)[None, :] < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    return accepted, jnp.take_along_axis(target_argmax, accepted[:, None], axis=1)[:, 0].astype(jnp.int32)


def _draw(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per row from ``probs [B, V]`` with per-row ``keys [B]``."""
    logp = jnp.log(jnp.maximum(probs, 0.0))
    return jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)


def speculative_accept(p: jax.Array, q: jax.Array, drafts: jax.Array, num_drafts: jax.Array,
                       keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The lossless acceptance rule of speculative sampling.

    Args:
      p: ``[B, K+1, V]`` the target's sampling distributions (``p[:, i]`` is the one draft ``i`` is judged by;
        ``p[:, K]`` is for the bonus token).  q: ``[B, K, V]`` the draft distributions ``drafts`` were drawn from.
      drafts: ``[B, K]`` i32.  num_drafts: ``[B]`` i32 in ``[0, K]``, drafts that count per row.
      keys: ``[B]`` per-row PRNG keys.
    Returns:
      ``(accepted [B] i32 in [0, num_drafts], next_token [B] i32)``: the row keeps ``drafts[:, :accepted]`` and
      then ``next_token``, drawn from ``max(p_n - q_n, 0)`` (normalised) after a rejection at ``n = accepted``
      or from ``p_n`` when every counted draft was kept. With one-hot ``p`` and ``q`` (greedy) this keeps drafts
      while they equal ``argmax p`` and then emits ``argmax p_n``.
    """
    b, k1, _ = p.shape
    k = k1 - 1
    u_keys = jax.vmap(lambda kk: jax.random.fold_in(kk, _TAG_ACCEPT))(keys)
    n_keys = jax.vmap(lambda kk: jax.random.fold_in(kk, _TAG_NEXT))(keys)
    u = 1.0 - jax.vmap(lambda kk: jax.random.uniform(kk, (k,), jnp.float32))(u_keys)  # (0, 1]
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    ok = (u * q_d <= p_d) & (jnp.arange(k)[None, :] < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    p_n = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    q_n = jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
    rejected = accepted < num_drafts
    residual = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # a rejection implies p_n(d) < q_n(d), hence mass > 0; the guard only covers float round-off
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
    dist = jnp.where(rejected[:, None], residual, p_n)
    return accepted, _draw(n_keys, dist)


class RoundOutput(NamedTuple):
    """One speculative round, per row: ``tokens [B, K+1]`` (the first ``emitted`` are new output),
    ``emitted [B]`` (accepted drafts + 1), and the model log-probs of each emitted token (``logprob [B, K+1]``,
    ``top_ids``/``top_logprobs [B, K+1, n]``)."""

    tokens: jax.Array
    emitted: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def _keep_trace_prefix(entry: dict, keep: jax.Array, lead: int) -> dict:
    """A KDA entry after ``keep [B]`` (>= 1) of the traced tokens: ``state_trace [*lead, B, T, H, K, V]`` ->
    ``state``, ``conv_trace [*lead, B, W-1+T, C]`` -> ``conv``. ``lead``: leading axes before the batch."""
    st, ct = entry["state_trace"], entry["conv_trace"]
    w1 = entry["conv"].shape[lead + 1]
    pre = (1,) * lead
    idx = (keep - 1).reshape(pre + (-1, 1, 1, 1, 1))
    state = jnp.take_along_axis(st, idx, axis=lead + 1).squeeze(lead + 1)
    pos = (keep[:, None] + jnp.arange(w1)[None, :]).reshape(pre + (-1, w1, 1))
    conv = jnp.take_along_axis(ct, pos, axis=lead + 1)
    return {"state": state, "conv": conv.astype(entry["conv"].dtype)}


def _rollback_target(new: dict, keep: jax.Array, lengths: jax.Array) -> dict:
    """The target cache after keeping ``keep [B]`` verified tokens per row, with ``lengths [B]``."""
    segs = []
    for seg in new["segments"]:
        segs.append({name: (_keep_trace_prefix(e, keep, 1) if "state_trace" in e else e) for name, e in seg.items()})
    return {"lengths": lengths, "segments": segs}


def speculative_round(target: K3ForCausalLM, draft: DraftModel, dcfg: DraftConfig, variables: dict,
                      draft_variables: dict, cache: dict, dcache: dict, last_token: jax.Array,
                      pend_feat: jax.Array, pend_tok: jax.Array, pend_n: jax.Array, active: jax.Array,
                      num_drafts: jax.Array, samp: SamplingArrays, num_top: int, sampling: bool = True,
                      table: jax.Array | None = None, view_dtype: Any = None):
    """One round for all rows (see the module docstring). Shapes: ``last_token [B]``, ``pend_feat [B, K+1, F]``,
    ``pend_tok [B, K+1]`` and ``pend_n [B]`` (pairs the draft has not consumed), ``active [B]`` bool,
    ``num_drafts [B]`` in ``[0, K]``. ``sampling`` (static): some row has ``temperature > 0``; ``False`` (every
    row greedy) drafts the draft's argmax and accepts with :func:`greedy_accept`: no distributions, sorts or
    random draws over the vocabulary, the same tokens as the sampling path gives greedy rows. ``table
    [B, max_pages]``: the target's cache is paged (:func:`k3_jax.serving.engine.apply_on_cache`, the view in
    ``view_dtype``): the verify pass writes its ``K + 1`` latent rows per active row into the row's pages at
    ``lengths .. lengths + K`` (positions past the row's mapped pages go to the null page; inactive rows write
    nothing), and the rollback only sets ``lengths``. Inactive rows keep their draft cache length. Returns
    ``(RoundOutput, cache, dcache, pend_feat, pend_tok, pend_n)``."""
    cfg = target.cfg
    k = pend_tok.shape[1] - 1
    b = last_token.shape[0]
    rows = jnp.arange(b)
    emb, head, vocab_map = draft_head(cfg, variables["params"], draft_variables)
    draft_variables = {"params": draft_variables["params"]}
    keys = (jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(samp.seed, samp.step) if sampling
            else None)

    def probs_of(logits: jax.Array) -> jax.Array:
        return sampling_probs(logits, samp.temperature, samp.top_k, samp.top_p)

    def draw_draft(logits: jax.Array, i: int) -> tuple[jax.Array | None, jax.Array]:
        """``(q [B, V] or None when greedy, token [B])`` from the draft's logits ``[B, 1, V or N]``: with a
        pruned head, index ``j`` is target token ``vocab_map[j]`` and ``q`` is zero outside the map."""
        if not sampling:
            j = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            return None, j if vocab_map is None else vocab_map[j]
        q = probs_of(logits)[:, 0]
        dk = jax.vmap(lambda kk: jax.random.fold_in(jax.random.fold_in(kk, _TAG_DRAFT), i))(keys)
        j = _draw(dk, q)
        if vocab_map is None:
            return q, j
        return jnp.zeros((b, cfg.vocab_size), q.dtype).at[:, vocab_map].set(q), vocab_map[j]

    # 1. catch-up on the pending pairs, first draft from the last real one
    last = jnp.clip(pend_n - 1, 0, k)
    if dcfg.mixer == "kda":
        with record_position_states():
            logits_c, hid_c, dc_new = draft.apply(draft_variables, pend_feat, pend_tok, emb, head, cache=dcache)
        layer = _keep_trace_prefix(dc_new["layer"], jnp.maximum(pend_n, 1), 0)
        # rows without pending pairs (idle slots) keep their entry
        layer = jax.tree.map(lambda new, old: jnp.where(
            (pend_n > 0).reshape((-1,) + (1,) * (new.ndim - 1)), new, old), layer, dcache["layer"])
    else:
        logits_c, hid_c, dc_new = draft.apply(draft_variables, pend_feat, pend_tok, emb, head, cache=dcache)
        layer = dc_new["layer"]
    # inactive rows (idle, or a prefilling request whose draft cache is being filled) keep their length: what the
    # catch-up wrote for them lies past it
    committed = {"lengths": jnp.where(active, dcache["lengths"] + pend_n, dcache["lengths"]), "layer": layer}
    logits_1 = logits_c[rows, last][:, None]
    hidden = hid_c[rows, last][:, None]
    q1, d1 = draw_draft(logits_1, 0)
    qs, ds = [q1], [d1]

    # 2. chain: the draft's own hidden state and token
    dc = committed
    for i in range(1, k):
        logits_i, hidden, dc = draft.apply(draft_variables, hidden, ds[-1][:, None], emb, head, cache=dc,
                                           from_draft=True)
        qi, di = draw_draft(logits_i, i)
        qs.append(qi)
        ds.append(di)
    drafts = jnp.stack(ds, axis=1)  # [B, K]

    # 3. verify all k + 1 positions at once
    tokens = jnp.concatenate([last_token[:, None], drafts], axis=1)
    with record_position_states():
        (logits_v, new_cache), collected = apply_on_cache(target, variables, tokens, cache, table, view_dtype, active,
                                                          mutable=[FEATURES])
    feats = target_features(cfg, dcfg, collected).astype(pend_feat.dtype)

    # 4. accept
    if sampling:
        n, nxt = speculative_accept(probs_of(logits_v), jnp.stack(qs, axis=1), drafts, jnp.clip(num_drafts, 0, k),
                                    keys)
    else:
        n, nxt = greedy_accept(jnp.argmax(logits_v, axis=-1).astype(jnp.int32), drafts, jnp.clip(num_drafts, 0, k))
    pos = jnp.arange(k + 1)[None, :]
    out_tokens = jnp.where(pos < n[:, None], jnp.concatenate([drafts, drafts[:, :1]], axis=1),
                           jnp.where(pos == n[:, None], nxt[:, None], 0)).astype(jnp.int32)

    # 5. roll back the target to the n + 1 kept tokens
    keep = n + 1
    cache = _rollback_target(new_cache, keep, jnp.where(active, cache["lengths"] + keep, 0))

    logp = jax.nn.log_softmax(logits_v.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, out_tokens[..., None], axis=-1)[..., 0]
    if num_top > 0:
        top_lp, top_ids = (x.reshape(b, k + 1, num_top) for x in top_k_in_chunks(logp.reshape(b * (k + 1), -1),
                                                                                  num_top))
    else:
        top_lp = jnp.zeros((b, k + 1, 0), jnp.float32)
        top_ids = jnp.zeros((b, k + 1, 0), jnp.int32)
    out = RoundOutput(out_tokens, keep.astype(jnp.int32), chosen, top_ids.astype(jnp.int32), top_lp)
    return out, cache, committed, feats, out_tokens, jnp.where(active, keep, 0).astype(jnp.int32)


def speculative_rounds(target: K3ForCausalLM, draft: DraftModel, dcfg: DraftConfig, variables: dict,
                       draft_variables: dict, cache: dict, dcache: dict, last_token: jax.Array,
                       pend: tuple[jax.Array, jax.Array, jax.Array], active: jax.Array, draft_len: jax.Array,
                       left: jax.Array, samp: SamplingArrays, num_top: int, sampling: bool, n: int,
                       table: jax.Array | None = None, view_dtype: Any = None):
    """``n`` rounds of :func:`speculative_round` in one ``lax.scan``, each fed the previous one's state: the last
    emitted token of a row, its sampling step (``samp.step`` + tokens emitted so far) and its tokens left.

    ``draft_len [B]``: drafts per round of each row (``k_b``); ``left [B]``: tokens each row may still emit. A round
    drafts ``min(k_b, left - 1)`` per row and runs a row only while ``left > 0`` (as :class:`SpeculativeEngine`
    does for single rounds), so the outputs equal ``n`` single rounds'. ``table`` / ``view_dtype``: a paged target
    cache (:func:`speculative_round`). Returns ``(RoundOutput with a leading
    [n] axis (``emitted`` 0 for a row in a round it did not run), cache, dcache, pend)``."""
    rows = jnp.arange(last_token.shape[0])

    def body(carry, _):
        cache, dcache, pend, last, step, left = carry
        run = active & (left > 0)
        num_drafts = jnp.minimum(draft_len, jnp.maximum(left - 1, 0))
        out, cache, dcache, pf, pt, pn = speculative_round(
            target, draft, dcfg, variables, draft_variables, cache, dcache, last, *pend, run, num_drafts,
            samp._replace(step=step), num_top, sampling, table, view_dtype)
        emitted = jnp.where(run, out.emitted, 0)
        last = jnp.where(run, out.tokens[rows, jnp.maximum(out.emitted - 1, 0)], last)
        return (cache, dcache, (pf, pt, pn), last, step + emitted, left - emitted), out._replace(emitted=emitted)

    (cache, dcache, pend, *_), outs = jax.lax.scan(body, (cache, dcache, pend, last_token, samp.step, left), None,
                                                   length=n)
    return outs, cache, dcache, pend


@dataclasses.dataclass
class SpecStats:
    """Counters of the speculative rounds: ``rounds`` (row-rounds), ``drafted``, ``accepted`` (drafts kept;
    ``accepted_hist``: row-rounds per number kept),
    ``emitted`` (tokens output), ``seconds`` (wall time of the rounds, host sync included)."""

    rounds: int = 0
    drafted: int = 0
    accepted_hist: dict[int, int] = dataclasses.field(default_factory=dict)  # drafts kept in a row-round -> count
    accepted: int = 0
    emitted: int = 0
    seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per row per round (1 = no draft accepted; at most ``k + 1``)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Tokens emitted by the rounds per second of round time."""
        return self.emitted / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"rounds": self.rounds, "accepted_hist": dict(sorted(self.accepted_hist.items())),
                "drafted": self.drafted, "accepted": self.accepted, "emitted": self.emitted,
                "acceptance_length": self.acceptance_length, "acceptance_rate": self.acceptance_rate,
                "accepted_tokens_per_s": self.tokens_per_second}


class SpeculativeEngine(Engine):
    """:class:`~k3_jax.serving.engine.Engine` whose decode step is a speculative round (module docstring).

    Args (beyond the engine's): ``draft_params`` (the draft's params or variables), ``draft_config``
    (:class:`~k3_jax.draft.DraftConfig`), ``num_draft_tokens`` (``k``, the most drafts per round).
    ``max_len`` is the per-request limit as for the engine; the cache holds ``k`` more positions, the room a
    verify pass needs at the end of a request. ``decode_block``: rounds per device call (:func:`speculative_rounds`;
    tokens stream in bursts; a block runs when no waiting request could take a free slot and no request is
    prefilling, else one round). With the engine's ``mesh``, the draft's parameters are placed by their logical
    names (a pruned head's map and head by :data:`k3_jax.draft.HEAD_AXES`) and its cache and pending pairs like
    the target's cache. :meth:`add_request` takes ``draft_tokens`` (``0 .. k``) per request. :attr:`spec` holds
    the round counters (:class:`SpecStats`).

    Paged cache (``paged=True``): a request reserves the pages a plain request does (prompt + ``max_tokens``); a
    verify pass writes ``k + 1`` latent rows at ``lengths .. lengths + k`` of its row, and only positions below
    the new length count. Committed tokens always lie inside the reservation (a round keeps at most ``left``
    tokens, the last one not yet in the cache), so no page is taken or returned per round: positions past the
    reservation go to the null page, rejected positions inside it are masked by length and overwritten by the
    next round, and the pages return to the pool when the request finishes.

    Prefix cache (``prefix_cache``): entries are only ever stored at a cache length the target has committed (a
    prefill piece ending on a snapshot endpoint, or a round whose kept tokens end on one): a round's drafts are
    capped so that it cannot pass the row's next endpoint, and a block of rounds runs only while no row can reach
    one. A request that hits starts from the restored KDA snapshot and pages, prefills the suffix, and drafts from
    there. The draft's own cache (not paged: one row of ``max_len + k + 1`` positions per slot) holds the
    (feature, token) pairs of the prefilled part only: the target features of a cached prefix are not stored, so
    after a hit the draft's own context starts at the restored endpoint (the target features it fuses carry the
    whole context). Outputs do not depend on it (verification is lossless); only acceptance can.
    """

    def __init__(self, cfg: K3Config, params: Any, draft_params: Any, draft_config: DraftConfig,
                 num_draft_tokens: int = 4, max_len: int = 512, vocab_map: Any = None, **kwargs: Any):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.dcfg = draft_config.validate(cfg)
        self.k = num_draft_tokens
        self.request_max_len = max_len
        self.draft = DraftModel(cfg, self.dcfg)
        self.draft_variables = {"params": unbox_params(draft_params)}
        super().__init__(cfg, params, max_len=max_len + num_draft_tokens, **kwargs)
        nf = cfg.hidden_size * len(self.dcfg.feature_layers)
        if self.mesh is not None:
            abstract = (jax.ShapeDtypeStruct((1, 2, nf), cfg.dtype), jax.ShapeDtypeStruct((1, 2), jnp.int32),
                        jax.ShapeDtypeStruct((cfg.vocab_size, cfg.hidden_size), cfg.dtype),
                        jax.ShapeDtypeStruct((cfg.hidden_size, cfg.vocab_size), cfg.dtype))
            self.draft_variables = shard_variables(self.draft, abstract, self.draft_variables, self.mesh,
                                                   self.sharding_preset)
        head = head_variables(cfg, self.dcfg, self.variables["params"], vocab_map)
        if self.mesh is not None:  # the map replicated, the pruned head split like the lm_head's columns
            placement = rules.logical_to_sharding({"draft": {k: HEAD_AXES[k] for k in head}}, self.mesh,
                                                  self.sharding_preset, {"draft": head})  # warnings name draft/head
            head = jax.device_put(head, placement["draft"])
        self.draft_variables.update(head)
        if self.mesh is None:  # committed, as the target's parameters (Engine._place)
            self.draft_variables = self._place(self.draft_variables)
        self._dcache_len = self.max_len + num_draft_tokens + 1
        self.dcache = self._place(init_draft_cache(cfg, self.dcfg, self.max_batch, self._dcache_len,
                                                   self._cache_dtype))
        self._pend = self._place((jnp.zeros((self.max_batch, self.k + 1, nf), self.compute_dtype),
                                  jnp.zeros((self.max_batch, self.k + 1), jnp.int32),
                                  jnp.zeros((self.max_batch,), jnp.int32)))
        self._draft_len = np.full(self.max_batch, self.k, np.int32)
        self._draft_len_by_id: dict[str, int] = {}
        self.spec = SpecStats()

    # ------------------------------------------------------------------ jitted functions
    def _build_fns(self) -> None:
        """The engine's functions, then the rounds' and the draft's (shared by engines of one layout and draft
        config, :func:`~k3_jax.serving.engine.shared_functions`), and the per-engine prefill that collects the
        prompt's target features."""
        super()._build_fns()
        key = (SpeculativeEngine, self._layout_key(), self.dcfg)
        for name, fn in shared_functions(key, self._speculative_functions).items():
            setattr(self, name, fn)

        def prefill_collecting(variables, cache, slot, tokens, table, media=None):
            logits, cache, feats = self._prefill_with_features(variables, cache, slot, tokens, table, media)
            self._prefill_feats.append(feats)
            return logits, cache

        self._prefill = prefill_collecting
        self._prefill_feats: list[jax.Array] = []

    def _speculative_functions(self) -> dict[str, Any]:
        """The rounds' and the draft's jitted functions; they capture the layout and draft config, never
        ``self``."""
        model, draft, dcfg, cfg, axes, cdt = self.model, self.draft, self.dcfg, self.cfg, self._axes, self.compute_dtype
        jit = jit_on_mesh(self.mesh, self.sharding_preset)
        pin = pin_to_cache_placement(self.mesh, self.sharding_preset)

        def prefill(variables, cache, slot, tokens, table, media=None):
            """As the engine's prefill, also returning the prompt piece's target features [1, T, F]."""
            row = take_cache_row(cache, slot, axes)
            row_table = None if table is None else jax.lax.dynamic_slice_in_dim(table, slot, 1, 0)
            hook = media_lib.media_embeds_hook(media, tokens, cfg.pad_token_id)
            # as the engine's prefill: a multi-token piece runs on the row's gathered view
            (logits, row), collected = apply_on_cache(model, variables, tokens, row, row_table, cdt,
                                                      jnp.ones((1,), bool), mutable=[FEATURES], embeds_hook=hook,
                                                      gather_view=tokens.shape[1] > 1)
            return (logits[0, -1].astype(jnp.float32), put_cache_row(cache, row, slot, axes),
                    target_features(cfg, dcfg, collected))

        def draft_prefill(dvars, variables, dcache, slot, feats, tokens):
            """The draft consumes prompt pairs ``feats [1, T, F]`` / ``tokens [1, T]`` into row ``slot``."""
            emb, head, _ = draft_head(cfg, variables["params"], dvars)
            row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, 0), dcache)
            _, _, row = draft.apply({"params": dvars["params"]}, feats, tokens, emb, head, cache=row)
            return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), slot, 0),
                                dcache, row)

        def draft_reset(dcache, pend, slot):
            """Zero draft row ``slot`` and its pending pairs."""
            dcache = jax.tree.map(lambda x: x.at[slot].set(jnp.zeros_like(x[slot])), dcache)
            return dcache, tuple(x.at[slot].set(jnp.zeros_like(x[slot])) for x in pend)

        def draft_pending(pend, slot, feat, token):
            """Make ``(feat [F], token)`` the only pending pair of row ``slot``."""
            pf, pt, pn = pend
            return (pf.at[slot].set(0).at[slot, 0].set(feat.astype(pf.dtype)),
                    pt.at[slot].set(0).at[slot, 0].set(token), pn.at[slot].set(1))

        def round_fn(variables, dvars, cache, dcache, last, pend, active, num_drafts, samp, num_top, sampling, table):
            out, cache, dcache, pf, pt, pn = speculative_round(
                model, draft, dcfg, variables, dvars, cache, dcache, last, *pend, active, num_drafts, samp, num_top,
                sampling, table, cdt)
            return out, cache, dcache, (pf, pt, pn)

        def rounds_fn(variables, dvars, cache, dcache, last, pend, active, draft_len, left, samp, num_top, sampling,
                      n, table):
            return speculative_rounds(model, draft, dcfg, variables, dvars, cache, dcache, last, pend, active,
                                      draft_len, left, samp, num_top, sampling, n, table, cdt)

        opts = {"compiler_options": self.model_compiler_options}  # the model steps' XLA options
        pin_state = lambda o: (o[0], pin(o[1]), pin(o[2]), pin(o[3]))  # noqa: E731 - (out, cache, dcache, pend)
        return {
            "_prefill_with_features": jit(prefill, lambda o: (o[0], pin(o[1]), o[2]), donate_argnums=(1,), **opts),
            "_draft_prefill": jit(draft_prefill, pin, donate_argnums=(2,), **opts),
            "_draft_reset": jit(draft_reset, lambda o: (pin(o[0]), pin(o[1])), donate_argnums=(0, 1)),
            "_draft_pending": jit(draft_pending, pin, donate_argnums=(0,)),
            "_round": jit(round_fn, pin_state, donate_argnums=(2, 3, 5), static_argnums=(9, 10), **opts),
            "_rounds": jit(rounds_fn, pin_state, donate_argnums=(2, 3, 5), static_argnums=(10, 11, 12), **opts),
        }

    # ------------------------------------------------------------------ requests
    def validate(self, prompt: Sequence[int], params: SamplingParams, media: Any = None) -> None:
        if len(prompt) >= self.request_max_len:
            raise RequestError(f"prompt has {len(prompt)} tokens; this engine's max_len is {self.request_max_len} "
                               f"(prompt + at least one generated token)")
        if isinstance(params, SamplingParams) and isinstance(params.max_tokens, int) and params.max_tokens > 0:
            # pages are checked for what the request can use (the engine's max_len holds k more positions)
            params = dataclasses.replace(params, max_tokens=min(params.max_tokens,
                                                                self.request_max_len - len(prompt)))
        super().validate(prompt, params, media)

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None,
                    media: Any = None, draft_tokens: int | None = None) -> str:
        """As :meth:`Engine.add_request`; ``draft_tokens`` (``0 .. k``, default ``k``) drafts per round."""
        if draft_tokens is not None and not (isinstance(draft_tokens, int) and 0 <= draft_tokens <= self.k):
            raise RequestError(f"draft_tokens must be an integer in [0, {self.k}], got {draft_tokens!r}")
        rid = super().add_request(prompt, params, request_id, media)
        req = self._by_id[rid]
        req.max_tokens = min(req.max_tokens, self.request_max_len - len(req.prompt))
        self._draft_len_by_id[rid] = self.k if draft_tokens is None else draft_tokens
        return rid

    def _start(self, req, slot: int, hit: Any) -> None:
        super()._start(req, slot, hit)
        self._draft_len[slot] = self._draft_len_by_id.pop(req.id, self.k)
        self.dcache, self._pend = self._draft_reset(self.dcache, self._pend, jnp.asarray(slot, jnp.int32))

    def _prefill_some(self, req) -> list:
        """The engine's prefill pieces of this step (collecting the target features of each); the draft then
        consumes the (feature, next prompt token) pairs of the positions they covered (the last prompt position has
        no next prompt token: once the prompt is in, its feature and the first sampled token become the pending
        pair). Only one step's features are held, whatever the prompt's length."""
        slot, start = req.slot, req.pos
        self._prefill_feats = []
        try:
            events = super()._prefill_some(req)
            feats = jnp.concatenate(self._prefill_feats, axis=1) if self._prefill_feats else None
        finally:
            self._prefill_feats = []
        if feats is None or self._slots[slot] is not req:  # nothing ran, or finished with its first token
            return events
        prompt = np.asarray(req.prompt, np.int32)
        slot_arr = jnp.asarray(slot, jnp.int32)
        pairs, pos = min(req.pos, len(prompt) - 1) - start, 0
        for n in _prefill_pieces(pairs, self.prefill_chunk, self.prefill_mode):
            self.dcache = self._draft_prefill(self.draft_variables, self.variables, self.dcache, slot_arr,
                                              feats[:, pos:pos + n],
                                              jnp.asarray(prompt[None, start + pos + 1:start + pos + 1 + n]))
            pos += n
        if not req.prefilling:
            self._pend = self._draft_pending(self._pend, slot_arr, feats[0, -1],
                                             jnp.asarray(self._last_token[slot], jnp.int32))
        return events

    def _fail_running(self, exc: BaseException) -> list:
        events = super()._fail_running(exc)
        leaves = jax.tree.leaves((self.dcache, self._pend))
        if any(x.is_deleted() for x in leaves if isinstance(x, jax.Array)):
            self.dcache = self._place(init_draft_cache(self.cfg, self.dcfg, self.max_batch, self._dcache_len,
                                                       self._cache_dtype))
            nf = self._pend[0].shape[-1]
            self._pend = self._place((jnp.zeros((self.max_batch, self.k + 1, nf), self.compute_dtype),
                                      jnp.zeros((self.max_batch, self.k + 1), jnp.int32),
                                      jnp.zeros((self.max_batch,), jnp.int32)))
        return events

    # ------------------------------------------------------------------ decoding
    def _block_size(self) -> int:
        """Rounds of the next device call: ``decode_block`` unless a waiting request could take a free slot, a
        request is prefilling, or (prefix cache) a row could reach a snapshot endpoint within the block (then 1).
        Rows with fewer tokens left stop inside the block on the device."""
        n = self.decode_block
        if n == 1 or (self._waiting and any(r is None for r in self._slots)):
            return 1
        if any(r is not None and r.prefilling for r in self._slots):
            return 1
        if self.prefix is not None and any(self._endpoint_within(r, n * (self.k + 1))
                                           for r in self._slots if r is not None):
            return 1
        return n

    def _endpoint_room(self) -> np.ndarray:
        """Per slot, the most drafts a round may keep without passing the row's next snapshot endpoint (``k`` for
        every slot without a prefix cache): a round keeps at most ``drafts + 1`` tokens."""
        room = np.full(self.max_batch, self.k, np.int32)
        if self.prefix is None:
            return room
        stride = self.prefix.config.stride
        for slot, req in enumerate(self._slots):
            if req is not None and not req.prefilling:
                held = len(req.prompt) + len(req.output) - 1
                room[slot] = (held // stride + 1) * stride - held - 1
        return room

    def _snapshot_rounds(self, active: np.ndarray, out: RoundOutput) -> None:
        """After a one-round call: a row whose cache now ends on a snapshot endpoint stores that entry (its
        committed tokens: prompt + the output before this round + the kept tokens of the round)."""
        stride = self.prefix.config.stride
        for slot, req in enumerate(self._slots):
            emitted = int(out.emitted[slot])
            if req is None or not active[slot] or emitted == 0:
                continue
            tokens = req.prompt + req.output + [int(t) for t in out.tokens[slot, :emitted]]
            held = len(tokens) - 1
            if held % stride == 0:
                self._snapshot(req, tokens, held)

    def _decode_step(self) -> list:
        t0 = time.perf_counter()
        active = np.asarray([r is not None and not r.prefilling for r in self._slots])
        steps = np.asarray([len(r.output) if r is not None else 0 for r in self._slots], np.int32)
        left = np.asarray([r.max_tokens - len(r.output) if r is not None else 1 for r in self._slots], np.int32)
        samp = SamplingArrays(
            temperature=jnp.asarray(self._samp["temperature"]), top_k=jnp.asarray(self._samp["top_k"]),
            top_p=jnp.asarray(self._samp["top_p"]), seed=jnp.asarray(self._samp["seed"]), step=jnp.asarray(steps))
        sampling = bool(np.any(self._samp["temperature"][active] > 0))  # static: greedy batches skip the sorts
        n = self._block_size()
        saved = self._save_prefilling_rows()
        num_drafts = np.minimum(np.minimum(self._draft_len, np.maximum(left - 1, 0)), self._endpoint_room())
        try:
            if n == 1:
                out, self.cache, self.dcache, self._pend = self._round(
                    self.variables, self.draft_variables, self.cache, self.dcache, jnp.asarray(self._last_token),
                    self._pend, jnp.asarray(active), jnp.asarray(num_drafts.astype(np.int32)), samp,
                    self.max_logprobs, sampling, self._table)
                outs = jax.tree.map(lambda x: x[None], jax.device_get(out))
            else:
                outs, self.cache, self.dcache, self._pend = self._rounds(
                    self.variables, self.draft_variables, self.cache, self.dcache, jnp.asarray(self._last_token),
                    self._pend, jnp.asarray(active), jnp.asarray(self._draft_len), jnp.asarray(left), samp,
                    self.max_logprobs, sampling, n, self._table)
                outs = jax.device_get(outs)
            self._restore_prefilling_rows(saved)
        except Exception as e:  # noqa: BLE001 - the batch's state is lost: fail its requests, keep the engine
            self.step_failures += 1
            self.last_step_error = f"{type(e).__name__}: {e}"
            return self._fail_running(e)
        self.step_failures = 0
        self.last_step_error = None
        if self.prefix is not None and n == 1:
            self._snapshot_rounds(active, jax.tree.map(lambda x: x[0], outs))
        self.stats["decode_steps"] += n
        events = []
        for r in range(n):
            out = jax.tree.map(lambda x, r=r: x[r], outs)
            for slot, req in enumerate(self._slots):
                emitted = int(out.emitted[slot])
                if req is None or not active[slot] or emitted == 0:  # finished earlier in the block: left
                    continue
                self.spec.rounds += 1
                self.spec.drafted += int(num_drafts[slot] if n == 1 else min(self._draft_len[slot],
                                                                               max(left[slot] - 1, 0)))
                left[slot] -= emitted
                self.spec.accepted += emitted - 1
                self.spec.accepted_hist[emitted - 1] = self.spec.accepted_hist.get(emitted - 1, 0) + 1
                for i in range(emitted):
                    tok = SampleOutput(out.tokens[:, i], out.logprob[:, i], out.top_ids[:, i], out.top_logprobs[:, i])
                    try:
                        ev = self._emit(req, int(out.tokens[slot, i]), tok, slot)
                    except Exception as e:  # noqa: BLE001 - this request alone fails
                        events.append(self._fail(req, e))
                        break
                    events.append(ev)
                    self.stats["decode_tokens"] += 1
                    self.spec.emitted += 1
                    if ev.finished:
                        break
        self.spec.seconds += time.perf_counter() - t0
        return events


def load_draft(directory: str, cfg: K3Config) -> tuple[DraftConfig, Any]:
    """``(DraftConfig, params)`` of a draft directory written by ``python -m k3_jax.training.draft``
    (``draft_config.json`` + the orbax ``params`` of the draft). A pruned-head draft's vocab map:
    :func:`k3_jax.draft.load_vocab_map`. FileNotFoundError without ``params/``; ValueError naming every parameter
    that does not fit a draft of ``cfg`` (:func:`k3_jax.draft.check_draft_params`)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    dcfg = DraftConfig.load(directory).validate(cfg)
    path = Path(directory).absolute() / "params"
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no draft params (expected the orbax directory the draft trainer exports)")
    params = nn.unbox(ocp.StandardCheckpointer().restore(path))
    check_draft_params(cfg, dcfg, params, f"{path}")
    return dcfg, params
