"""EAGLE-3 style draft model for speculative decoding of a K3 target.

The draft sees, per position ``i``, the target's residual stream at a few of its layers (low, middle, high;
:attr:`DraftConfig.feature_layers`) after token ``i`` and the embedding of token ``i + 1``, and predicts token
``i + 2``:

    f  = fc(concat(residual_l for l in feature_layers))           [B, T, n·D] -> [B, T, D]
    x  = fuse(concat(norm(embed(token_{i+1})), norm(f)))           [B, T, 2·D] -> [B, T, D]
    x += mixer(norm(x))          one MLA or KDA layer of the target's shape (own cache)
    x += SituMLP(norm(x))        dense, ``intermediate_size``
    logits = norm(x) · lm_head   the target's frozen lm_head (and embedding table), or its rows of a pruned
                                 vocabulary (``head_vocab``; :func:`pruned_head`)

``x`` (before the final norm) is the draft's hidden state: chained drafting (and the training-time test unroll)
feeds it back in place of ``f`` for the next position (``from_draft=True`` skips ``fc``).

Parameters are the draft's own (``fc``, ``fuse``, norms, mixer, mlp); the embedding table and the lm_head kernel
are arguments, taken from the target's parameters with :func:`target_head`. Residual features come from the
target's opt-in :data:`k3_jax.model.FEATURES` collection (:func:`target_features`).

Pruned head (``DraftConfig.head_vocab = N``): the draft predicts over the ``N`` target ids of a ``vocab_map
[N]`` i32 (distinct ids in ``[0, V)``, most frequent first; :func:`count_vocab_map`), stored beside the draft
(:data:`VOCAB_MAP_FILE`). Its head is ``lm_head[:, vocab_map]`` ``[D, N]``, gathered once at load; draft logits
are ``[B, T, N]`` and index ``j`` stands for target token ``vocab_map[j]``. The draft's distribution over the full
vocabulary is zero outside the map.

On a mesh (:class:`k3_jax.serving.speculative.SpeculativeEngine` with ``mesh``) the head entries are placed by
:data:`HEAD_AXES` under the engine's preset; in training the pruned head is gathered inside the step from the
target's placed lm_head.

Cache (decode): ``{"lengths": [B] i32, "layer": entry}`` with the KDA or MLA entry of :mod:`k3_jax.cache`
without the ``repeats`` axis (:func:`init_draft_cache`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.config import K3Config
from k3_jax.layers.common import Linear, RMSNorm, compute_dtype
from k3_jax.layers.kda import KimiDeltaAttention
from k3_jax.layers.mla import KimiMLAAttention
from k3_jax.layers.moe import SituMLP
from k3_jax.model import FEATURES, layer_plan, lm_head_logits

MIXERS = ("mla", "kda")
DRAFT_CONFIG_FILE = "draft_config.json"
VOCAB_MAP_FILE = "vocab_map.npy"
# logical axis names of :func:`head_variables`' entries: on a mesh the map is replicated (every device gathers with
# it) and the pruned head is split as the target's lm_head columns are (``vocab``)
HEAD_AXES: dict[str, tuple[str | None, ...]] = {"vocab_map": (None,), "head": ("embed", "vocab")}


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """What the draft fuses and how it is built.

    ``feature_layers``: target layer indices (0-based, each in ``[0, num_layers)``) whose residual stream is fused,
    in order; ``mixer``: ``"mla"`` (default: its latent cache rolls back by truncating ``lengths``, so drafting
    needs no state trace; one latent row of ``kv_lora + rope`` values per token) or ``"kda"``;
    ``intermediate_size``: the dense MLP width (0: the target's ``intermediate_size``); ``head_vocab``: ``None``
    (the full lm_head) or ``N`` in ``[1, V]``: a pruned head over the ``N`` ids of the draft's vocab map.
    """

    feature_layers: tuple[int, ...]
    mixer: str = "mla"
    intermediate_size: int = 0
    head_vocab: int | None = None

    @staticmethod
    def default_for(cfg: K3Config, mixer: str = "mla") -> DraftConfig:
        """Low / middle / high layers as EAGLE-3 picks them: ``(1, L // 2, L - 2)`` (clipped, deduplicated)."""
        n = cfg.num_hidden_layers
        layers = tuple(dict.fromkeys(min(max(i, 0), n - 1) for i in (1, n // 2, n - 2)))
        return DraftConfig(layers, mixer)

    def validate(self, cfg: K3Config) -> DraftConfig:
        """Raise ``ValueError`` naming the bad field against the target ``cfg``; return self."""
        if self.mixer not in MIXERS:
            raise ValueError(f"draft mixer must be one of {MIXERS}, got {self.mixer!r}")
        if not self.feature_layers:
            raise ValueError("draft feature_layers is empty: at least one target layer is needed")
        bad = [i for i in self.feature_layers if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"draft feature_layers {bad} outside the target's layers [0, {cfg.num_hidden_layers})")
        if self.intermediate_size < 0:
            raise ValueError(f"draft intermediate_size must be >= 0, got {self.intermediate_size}")
        if self.head_vocab is not None and not 1 <= self.head_vocab <= cfg.vocab_size:
            raise ValueError(f"draft head_vocab must be None or in [1, {cfg.vocab_size}] (the target's vocab_size), "
                             f"got {self.head_vocab}")
        return self

    def mlp_size(self, cfg: K3Config) -> int:
        return self.intermediate_size or cfg.intermediate_size

    def to_json(self) -> dict:
        return {"feature_layers": list(self.feature_layers), "mixer": self.mixer,
                "intermediate_size": self.intermediate_size, "head_vocab": self.head_vocab}

    @staticmethod
    def from_json(d: dict) -> DraftConfig:
        unknown = set(d) - {"feature_layers", "mixer", "intermediate_size", "head_vocab"}
        if unknown:
            raise ValueError(f"draft config has unknown fields {sorted(unknown)}")
        hv = d.get("head_vocab")
        return DraftConfig(tuple(int(i) for i in d["feature_layers"]), str(d.get("mixer", "mla")),
                           int(d.get("intermediate_size", 0)), None if hv is None else int(hv))

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / DRAFT_CONFIG_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        tmp.rename(path)

    @staticmethod
    def load(directory: str | Path) -> DraftConfig:
        path = Path(directory) / DRAFT_CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no draft config (is {directory} a draft directory?)")
        try:
            return DraftConfig.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: bad draft config: {e}") from None


class DraftModel(nn.Module):
    """``(inputs, tokens, embedding [V, D], lm_head [D, V], cache=None, from_draft=False)`` ->
    ``(logits [B, T, V] f32, hidden [B, T, D] cfg.dtype, new_cache or None)``.

    ``inputs``: target features ``[B, T, n·D]`` (:func:`target_features`) or, with ``from_draft``, the draft's own
    hidden ``[B, T, D]``; ``tokens [B, T]`` i32: the token after each feature's position; ``segment_ids [B, T]``
    (training on packed rows, no cache): the mixer never crosses a document.
    """

    cfg: K3Config
    dcfg: DraftConfig

    @nn.compact
    def __call__(self, inputs: jax.Array, tokens: jax.Array, embedding: jax.Array, lm_head: jax.Array,
                 cache: dict | None = None, from_draft: bool = False,
                 segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array, dict | None]:
        cfg, d = self.cfg, self.cfg.hidden_size
        dt, pd, eps = compute_dtype(cfg), cfg.param_dtype, cfg.rms_norm_eps
        e = jnp.take(jax.lax.stop_gradient(embedding), tokens, axis=0).astype(dt)
        want = d if from_draft else d * len(self.dcfg.feature_layers)
        if inputs.shape[-1] != want:
            raise ValueError(f"draft inputs have {inputs.shape[-1]} features, expected {want} "
                             f"({'draft hidden' if from_draft else 'target features'})")
        if from_draft:
            f = inputs.astype(dt)
        else:
            f = Linear(d, (None, "embed"), cfg, name="fc")(inputs.astype(dt))
        pair = jnp.concatenate([RMSNorm(eps, ("embed",), pd, name="embed_norm")(e),
                                RMSNorm(eps, ("embed",), pd, name="feature_norm")(f)], axis=-1)
        x = Linear(d, (None, "embed"), cfg, name="fuse")(pair)
        h = RMSNorm(eps, ("embed",), pd, name="input_layernorm")(x)
        entry = None if cache is None else cache["layer"]
        if self.dcfg.mixer == "kda":
            a, entry = KimiDeltaAttention(cfg, name="self_attn")(h, segment_ids, entry)
        else:
            a, entry = KimiMLAAttention(cfg, name="self_attn")(h, segment_ids, entry,
                                                               None if cache is None else cache["lengths"])
        x = (x + a).astype(dt)
        m = SituMLP(cfg, self.dcfg.mlp_size(cfg), name="mlp")(
            RMSNorm(eps, ("embed",), pd, name="post_attention_layernorm")(x))
        x = (x + m).astype(dt)
        out = RMSNorm(eps, ("embed",), pd, name="norm")(x)
        logits = lm_head_logits(out.astype(dt), jax.lax.stop_gradient(lm_head).astype(dt))  # as the target's
        new_cache = None
        if cache is not None:
            new_cache = {"lengths": cache["lengths"] + tokens.shape[1], "layer": entry}
        return logits, x, new_cache


def init_draft_cache(cfg: K3Config, dcfg: DraftConfig, batch: int, max_len: int,
                     dtype: str | jnp.dtype | None = None) -> dict:
    """An empty draft cache for ``batch`` rows of up to ``max_len`` positions."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    if dcfg.mixer == "kda":
        h, k = cfg.kda_num_heads, cfg.kda_head_dim
        entry = {"state": jnp.zeros((batch, h, k, k), jnp.float32),
                 "conv": jnp.zeros((batch, cfg.short_conv_kernel_size - 1, 3 * h * k), dtype)}
    else:
        entry = {"latent": jnp.zeros((batch, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dtype)}
    return {"lengths": jnp.zeros((batch,), jnp.int32), "layer": entry}


def count_vocab_map(token_batches: Iterable[np.ndarray], vocab_size: int, n: int) -> np.ndarray:
    """The ``n`` most frequent ids ``[n]`` i32 over ``token_batches`` (any shape, ids in ``[0, vocab_size)``;
    ties and unseen ids by ascending id), most frequent first."""
    counts = np.zeros(vocab_size, np.int64)
    for t in token_batches:
        t = np.asarray(t).reshape(-1)
        if t.size and (t.min() < 0 or t.max() >= vocab_size):
            raise ValueError(f"corpus token ids outside [0, {vocab_size}) (min {t.min()}, max {t.max()})")
        counts += np.bincount(t, minlength=vocab_size)
    return np.argsort(-counts, kind="stable")[:n].astype(np.int32)


def check_vocab_map(vocab_map: Any, dcfg: DraftConfig, vocab_size: int, where: str = "vocab_map") -> np.ndarray:
    """``vocab_map`` as ``[head_vocab]`` i32; ``ValueError`` naming ``where`` and the field when its length is
    not ``dcfg.head_vocab``, an id lies outside ``[0, vocab_size)`` or an id repeats."""
    m = np.asarray(vocab_map)
    if dcfg.head_vocab is None:
        raise ValueError(f"{where}: the draft config has head_vocab=None (full head) but a vocab map was given")
    if m.ndim != 1 or m.shape[0] != dcfg.head_vocab or not np.issubdtype(m.dtype, np.integer):
        raise ValueError(f"{where}: expected [head_vocab={dcfg.head_vocab}] integer ids, got shape {m.shape} "
                         f"dtype {m.dtype}")
    if m.min() < 0 or m.max() >= vocab_size:
        raise ValueError(f"{where}: ids outside [0, {vocab_size}) (min {m.min()}, max {m.max()})")
    if np.unique(m).size != m.size:
        raise ValueError(f"{where}: {m.size - np.unique(m).size} repeated ids")
    return m.astype(np.int32)


def save_vocab_map(directory: str | Path, vocab_map: np.ndarray) -> None:
    """Write ``directory/``:data:`VOCAB_MAP_FILE` (temp file, then rename)."""
    path = Path(directory) / VOCAB_MAP_FILE
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, np.asarray(vocab_map, np.int32))
    tmp.rename(path)


def load_vocab_map(directory: str | Path, dcfg: DraftConfig, vocab_size: int) -> np.ndarray | None:
    """The draft's vocab map (``None`` for a full head), checked by :func:`check_vocab_map`;
    ``FileNotFoundError`` when ``head_vocab`` is set and the file is missing."""
    path = Path(directory) / VOCAB_MAP_FILE
    if dcfg.head_vocab is None:
        if path.exists():
            raise ValueError(f"{path}: the draft config has head_vocab=None (full head) but a vocab map is stored")
        return None
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing: the draft config has head_vocab={dcfg.head_vocab}")
    return check_vocab_map(np.load(path), dcfg, vocab_size, str(path))


def pruned_head(lm_head: jax.Array, vocab_map: jax.Array) -> jax.Array:
    """The draft head ``[D, N]``: the target's ``lm_head [D, V]`` columns of ``vocab_map [N]``."""
    return jnp.take(lm_head, jnp.asarray(vocab_map), axis=1)


def head_variables(cfg: K3Config, dcfg: DraftConfig, target_params: dict, vocab_map: Any) -> dict:
    """What a pruned-head draft adds to its variables: ``{"vocab_map": [N] i32, "head": [D, N]}`` (gathered
    once from the target); ``{}`` for a full head."""
    if dcfg.head_vocab is None:
        if vocab_map is not None:
            raise ValueError("vocab_map given for a draft with head_vocab=None (full head)")
        return {}
    if vocab_map is None:
        raise ValueError(f"the draft config has head_vocab={dcfg.head_vocab} but no vocab_map was given")
    m = check_vocab_map(vocab_map, dcfg, cfg.vocab_size)
    _, head = target_head(cfg, target_params)
    return {"vocab_map": jnp.asarray(m), "head": pruned_head(head, m)}


def draft_head(cfg: K3Config, target_params: dict, draft_variables: dict) -> tuple[jax.Array, jax.Array,
                                                                                  jax.Array | None]:
    """``(embedding [V, D], draft head [D, N or V], vocab_map [N] or None)`` for a draft's variables (with or
    without :func:`head_variables`' entries)."""
    emb, head = target_head(cfg, target_params)
    if "head" in draft_variables:
        return emb, draft_variables["head"], draft_variables["vocab_map"]
    return emb, head, None


def target_head(cfg: K3Config, target_params: dict) -> tuple[jax.Array, jax.Array]:
    """``(embedding [V, D], lm_head [D, V])`` from the target's ``params`` tree (boxed or plain)."""
    target_params = nn.unbox(target_params)
    emb = target_params["model"]["embed_tokens"]["embedding"]
    head = emb.T if cfg.tie_word_embeddings else target_params["lm_head"]["kernel"]
    return emb, head


def _layer_locations(cfg: K3Config) -> dict[int, tuple[int, int, int]]:
    """``{layer: (segment, position in the group, repeat)}`` of :func:`k3_jax.model.layer_plan`."""
    out = {}
    for s, seg in enumerate(layer_plan(cfg)):
        for r in range(seg.repeats):
            for j in range(seg.period):
                out[seg.layer(r, j)] = (s, j, r)
    return out


def target_features(cfg: K3Config, dcfg: DraftConfig, collected: dict) -> jax.Array:
    """Concatenate the residuals of ``dcfg.feature_layers`` from the target's ``mutable=[FEATURES]`` output
    (the returned variables dict or its :data:`~k3_jax.model.FEATURES` entry) -> ``[B, T, n·D]``."""
    tree = collected.get(FEATURES, collected)
    segs = tree["model"]
    where = _layer_locations(cfg)
    parts = []
    for layer in dcfg.feature_layers:
        s, j, r = where[layer]
        # sow appends to a tuple (a rematerialised layer sows once per trace): the last entry, [repeats, B, T, D]
        parts.append(segs[f"segment_{s}"][f"layer_{j}"]["residual"][-1][r])
    return jnp.concatenate(parts, axis=-1)


def draft_param_shapes(cfg: K3Config, dcfg: DraftConfig) -> dict:
    """The draft's ``params`` tree of ``jax.ShapeDtypeStruct`` (nothing computed; the embedding and lm_head are the
    target's, not in it)."""
    shapes = jax.eval_shape(lambda: DraftModel(cfg, dcfg).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 1, cfg.hidden_size * len(dcfg.feature_layers))),
        jnp.zeros((1, 1), jnp.int32), jnp.zeros((cfg.vocab_size, cfg.hidden_size)),
        jnp.zeros((cfg.hidden_size, cfg.vocab_size))))
    return unbox_params(shapes)


def draft_param_count(cfg: K3Config, dcfg: DraftConfig) -> int:
    """Parameters the draft adds (the embedding and lm_head are the target's)."""
    return sum(int(x.size) for x in jax.tree.leaves(draft_param_shapes(cfg, dcfg)))


def check_draft_params(cfg: K3Config, dcfg: DraftConfig, params: Any, where: str = "draft params") -> None:
    """ValueError naming ``where`` and every parameter missing, unexpected or of another shape than the draft of
    ``(cfg, dcfg)`` has (e.g. a draft trained for another target), instead of a shape error in the first round."""
    want = {jax.tree_util.keystr(k): tuple(x.shape)
            for k, x in jax.tree_util.tree_leaves_with_path(draft_param_shapes(cfg, dcfg))}
    got = {jax.tree_util.keystr(k): tuple(np.shape(x)) for k, x in jax.tree_util.tree_leaves_with_path(
        unbox_params(params))}
    problems = [f"{k}: missing (expected shape {want[k]})" for k in want if k not in got]
    problems += [f"{k}: unexpected (shape {got[k]})" for k in got if k not in want]
    problems += [f"{k}: expected shape {want[k]}, got {got[k]}" for k in want if k in got and got[k] != want[k]]
    if problems:
        raise ValueError(f"{where}: not a draft for this target (hidden_size {cfg.hidden_size}, draft mixer "
                         f"{dcfg.mixer!r}, feature_layers {list(dcfg.feature_layers)}): " + "; ".join(problems[:6])
                         + (f"; ... {len(problems) - 6} more" if len(problems) > 6 else ""))


def unbox_params(variables: Any) -> Any:
    """``params`` of a (possibly boxed) variables dict or params tree."""
    variables = nn.unbox(variables)
    return variables["params"] if "params" in variables else variables
