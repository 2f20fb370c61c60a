"""Logical axis names → mesh axes: the one table that says how k3-jax is laid out on a device mesh.

Parameters and activations carry *logical* names (``embed``, ``heads``, ``experts`` … see
:data:`LOGICAL_AXES`); a *preset* is an ordered list of rules ``(logical_name, mesh_axes)`` in the
``flax.linen`` format (``mesh_axes`` is a mesh axis name, a tuple of them, or ``None``). Rules are tried in
order; a rule applies when its mesh axes are not yet used by another dimension of the same array (so a
logical name may have several rules, the later ones being fallbacks) — exactly
``flax.linen.logical_to_mesh_axes``. On top of flax, :func:`logical_to_pspec` drops mesh axes that are not in
the mesh and, given a shape, drops mesh axes a dimension is not divisible by (with a
:class:`ShardingFallbackWarning`) instead of failing.

Built-in presets:

* ``train`` — FSDP + expert + tensor: batch over (data, fsdp, expert); parameters' ``embed``/``latent``
  dimension over (fsdp, expert) (ZeRO-3), heads / MLP widths / vocabulary over ``tensor``, routed experts
  over ``expert``; a LoRA adapter's ``lora_rank`` over ``fsdp`` (else ``tensor``) where its other dimension left
  it free. ``length`` is not sharded.
* ``serve`` — tensor + expert, replicated batch (decode): heads / widths / vocabulary / LatentMoE latent over
  ``tensor`` and experts over ``expert``; ``embed`` replicated, batch over ``data`` (replicas) only.
* ``long-context`` — ``train`` plus ``length`` over ``sequence`` (and ``sequence`` joins the FSDP group of the
  parameters so those devices do not hold replicated weights).

User presets: :func:`register_preset` ``(name, rules)`` or JSON files ``configs/sharding/<name>.json``
(``{"name": ..., "rules": [["embed", ["fsdp", "expert"]], ["heads", "tensor"], ["norm", null], ...],
"replicated_ok": [path substrings]}``),
loaded by :func:`load_preset_file` / discovered by :func:`get_preset`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

LOGICAL_AXES: tuple[str, ...] = (
    "vocab",           # vocabulary rows of the embedding / columns of lm_head
    "embed",           # hidden size D
    "layers",          # stacked layers of a scanned segment
    "kda_heads",       # KDA heads (H·K of the q/k/v/g projections, H of the gate parameters, the state)
    "heads",           # MLA heads
    "head_dim",        # per-head width of the norms
    "q_lora",          # MLA query low rank
    "kv_lora",         # MLA latent (the cached ĉ and k_rot)
    "gate_lowrank",    # KDA forget-gate low rank (f_a_proj output, f_b_proj input; = head_dim)
    "experts",         # routed experts of the expert weights
    "router_experts",  # the router's expert dimension (scores [T, E] feed a top-k over all experts)
    "expert_mlp",      # routed-expert intermediate size
    "latent",          # LatentMoE latent width
    "mlp",             # dense / shared-expert intermediate size
    "conv",            # short-conv taps
    "batch",           # activation rows
    "length",          # activation tokens
    "norm",            # norm scales
    "vision_embed",    # vision tower width
    "vision_mlp",      # vision tower MLP intermediate size
    "vision_in",       # projector input (merged 2x2 patches)
    "vision_out",      # projector output (= text hidden size)
    "vision_pos_h",    # learned position grid rows
    "vision_pos_w",    # learned position grid columns
    "lora_rank",       # the rank of a LoRA adapter (k3_jax.training.lora; a: [.., in, rank], b: [.., rank, out])
)

_TRAIN: Rules = (
    # activations first: the batch claims the data-parallel axes, so `embed` of an activation falls through
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    # tensor-parallel widths
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kda_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert_mlp", "tensor"),
    # routed experts
    ("experts", "expert"),
    # FSDP (ZeRO-3) dimension of the parameters; fallbacks when `expert` is taken (router, expert weights)
    # (`tensor` joins when the other dimension has no tensor-parallel name, e.g. the router / latent projections)
    ("embed", ("fsdp", "expert", "tensor")),
    ("embed", ("fsdp", "expert")),
    ("embed", "fsdp"),
    ("latent", ("fsdp", "expert")),
    ("latent", "fsdp"),
    ("q_lora", ("fsdp", "expert")),
    ("q_lora", "fsdp"),
    ("kv_lora", ("fsdp", "expert")),
    ("kv_lora", "fsdp"),
    ("gate_lowrank", ("fsdp", "expert")),  # f_b_proj [gate_lowrank, kda_heads]; f_a_proj's embed took fsdp
    ("gate_lowrank", "fsdp"),
    # LoRA adapters, ZeRO-3 like their base: the rank takes the axis the adapter's other dimension left free.
    # After every weight name's rules, so `embed`/`latent`/... claim the FSDP axes first: a routed expert's B
    # [experts, lora_rank, expert_mlp] gets expert × fsdp × tensor, w2's B [experts, lora_rank, latent] rank over
    # tensor, a q_proj B [lora_rank, heads] fsdp × tensor. One axis, not (fsdp, expert): a rank of 16 divides
    # fsdp=8 or 16 (a rank the axis does not divide stays whole, with a ShardingFallbackWarning).
    ("lora_rank", "fsdp"),
    ("lora_rank", "tensor"),
    ("router_experts", None),  # kept whole: the router kernel's embed dimension carries the FSDP split
    ("layers", None),
    ("head_dim", None),
    ("conv", None),
    ("norm", None),
    # the vision tower: its width FSDP-sharded in training, everything else replicated; never expert-sharded
    ("vision_embed", "fsdp"),
    *((n, None) for n in ("vision_mlp", "vision_in", "vision_out", "vision_pos_h", "vision_pos_w")),
)

_SERVE: Rules = (
    ("batch", "data"),
    ("length", None),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kda_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert_mlp", "tensor"),
    ("experts", "expert"),
    ("latent", "tensor"),  # LatentMoE down/up projections; expert weights already took `tensor` for I
    ("embed", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("gate_lowrank", None),  # 128-wide: replicated (see REPLICATED_OK), kda_heads splits f_b_proj
    ("lora_rank", None),  # adapters are merged (or small) when serving
    ("router_experts", None),  # the router is replicated in decode (one all-gather fewer per token)
    ("layers", None),
    ("head_dim", None),
    ("conv", None),
    ("norm", None),
    # the vision tower is replicated for serving (a data-parallel encoder)
    *((n, None) for n in ("vision_embed", "vision_mlp", "vision_in", "vision_out", "vision_pos_h", "vision_pos_w")),
)

_LONG_CONTEXT: Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", "sequence"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kda_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert_mlp", "tensor"),
    ("experts", "expert"),
    ("embed", ("fsdp", "sequence", "expert", "tensor")),
    ("embed", ("fsdp", "sequence", "expert")),
    ("embed", ("fsdp", "sequence")),
    ("embed", "fsdp"),
    ("latent", ("fsdp", "sequence", "expert")),
    ("latent", ("fsdp", "sequence")),
    ("q_lora", ("fsdp", "sequence", "expert")),
    ("q_lora", ("fsdp", "sequence")),
    ("kv_lora", ("fsdp", "sequence", "expert")),
    ("kv_lora", ("fsdp", "sequence")),
    ("gate_lowrank", ("fsdp", "sequence", "expert")),
    ("gate_lowrank", ("fsdp", "sequence")),
    ("lora_rank", "fsdp"),
    ("lora_rank", "tensor"),
    ("router_experts", None),
    ("layers", None),
    ("head_dim", None),
    ("conv", None),
    ("norm", None),
    ("vision_embed", "fsdp"),
    *((n, None) for n in ("vision_mlp", "vision_in", "vision_out", "vision_pos_h", "vision_pos_w")),
)

_PRESETS: dict[str, Rules] = {"train": _TRAIN, "serve": _SERVE, "long-context": _LONG_CONTEXT}

PRESET_DIR_ENV = "K3_SHARDING_PRESETS"  # extra directory of JSON presets


class ShardingFallbackWarning(UserWarning):
    """A mesh axis was dropped for a dimension it does not divide (the dimension is less sharded)."""


class PresetError(KeyError):
    """Unknown or malformed sharding preset."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


# ----------------------------------------------------------------------------- presets
def _normalize_rules(rules: Any, where: str) -> Rules:
    out: list[tuple[str, MeshAxes]] = []
    if isinstance(rules, Mapping):
        rules = list(rules.items())
    for i, item in enumerate(rules):
        if not isinstance(item, list | tuple) or len(item) != 2 or not isinstance(item[0], str):
            raise PresetError(f"{where}: rule {i} must be [logical_name, mesh_axes], got {item!r}")
        name, axes = item
        if isinstance(axes, list | tuple):
            axes = tuple(str(a) for a in axes)
            if not all(isinstance(a, str) for a in axes):
                raise PresetError(f"{where}: rule {i} ({name!r}) mesh axes must be strings, got {axes!r}")
        elif axes is not None and not isinstance(axes, str):
            raise PresetError(f"{where}: rule {i} ({name!r}) mesh axes must be a name, a list or null, "
                              f"got {axes!r}")
        out.append((name, axes))
    return tuple(out)


def register_preset(name: str, rules: Sequence[tuple[str, MeshAxes]] | Mapping[str, MeshAxes],
                    overwrite: bool = False, replicated_ok: Sequence[str] = ()) -> Rules:
    """Add a named preset (flax-style ordered rules or a ``{logical: mesh_axes}`` mapping); ``replicated_ok``
    lists path substrings of parameters the preset deliberately leaves replicated."""
    if name in _PRESETS and not overwrite:
        raise PresetError(f"sharding preset {name!r} already exists; pass overwrite=True to replace it")
    _PRESETS[name] = _normalize_rules(rules, f"preset {name!r}")
    if replicated_ok:
        REPLICATED_OK[name] = tuple(replicated_ok)
    return _PRESETS[name]


def load_preset_file(path: str | os.PathLike[str], overwrite: bool = True) -> str:
    """Register the preset in a JSON file ``{"name": ..., "rules": [[logical, mesh_axes], ...]}``; returns its name."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise PresetError(f"sharding preset file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise PresetError(f"sharding preset file {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or "rules" not in raw:
        raise PresetError(f"sharding preset file {str(path)!r}: expected an object with key 'rules'")
    name = raw.get("name", path.stem)
    register_preset(name, _normalize_rules(raw["rules"], str(path)), overwrite=overwrite,
                    replicated_ok=raw.get("replicated_ok", ()))
    return name


def _preset_dirs() -> list[Path]:
    from k3_jax.config import bundled_config_dirs

    dirs = [Path(d) / "sharding" for d in bundled_config_dirs()]
    if os.environ.get(PRESET_DIR_ENV):
        dirs.append(Path(os.environ[PRESET_DIR_ENV]))
    return dirs


def preset_names() -> list[str]:
    """Names of the registered presets plus those found as JSON in the preset directories."""
    names = set(_PRESETS)
    for d in _preset_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.json"))
    return sorted(names)


def get_preset(preset: str | Sequence[tuple[str, MeshAxes]]) -> Rules:
    """Rules of a preset by name (registered, or ``configs/sharding/<name>.json``), a JSON path, or rules."""
    if not isinstance(preset, str):
        return _normalize_rules(preset, "rules")
    if preset in _PRESETS:
        return _PRESETS[preset]
    if preset.endswith(".json") and os.path.exists(preset):
        return _PRESETS[load_preset_file(preset)]
    for d in _preset_dirs():
        p = d / f"{preset}.json"
        if p.exists():
            return _PRESETS[load_preset_file(p)]
    raise PresetError(f"unknown sharding preset {preset!r}; known: {preset_names()}")


# ----------------------------------------------------------------------------- resolution
def _axes_tuple(a: MeshAxes) -> tuple[str, ...]:
    if a is None:
        return ()
    return (a,) if isinstance(a, str) else tuple(a)


def _mesh_sizes(mesh: Mesh | Mapping[str, int] | None) -> dict[str, int] | None:
    if mesh is None:
        return None
    if isinstance(mesh, Mapping):
        return dict(mesh)
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def logical_to_pspec(names: Sequence[str | None] | None, rules: Rules | str,
                     mesh: Mesh | Mapping[str, int] | None = None,
                     shape: Sequence[int] | None = None, what: str = "") -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry logical ``names``.

    Same priority semantics as ``flax.linen.logical_to_mesh_axes``. With ``mesh``, mesh axes absent from it or
    of size 1 are dropped; with ``shape``, trailing mesh axes of a dimension are dropped until the dimension is
    divisible by the product of the rest (``ShardingFallbackWarning`` naming ``what``).
    """
    if names is None:
        return PartitionSpec()
    rules = get_preset(rules) if isinstance(rules, str) else rules
    names = tuple(names)
    dups = {n for n in names if isinstance(n, str) and names.count(n) > 1}
    if dups:
        raise ValueError(f"{what or 'array'}: logical names {sorted(dups)} occur more than once in {names}")
    result: list[tuple[str, ...] | None] = [None] * len(names)
    assigned = [False] * len(names)
    used: set[str] = set()
    for lname, maxes in rules:
        if lname not in names:
            continue
        pos = names.index(lname)
        axes = _axes_tuple(maxes)
        if assigned[pos] or used.intersection(axes):
            continue
        result[pos] = axes
        assigned[pos] = True
        used.update(axes)
    sizes = _mesh_sizes(mesh)
    out: list[Any] = []
    for i, axes in enumerate(result):
        axes = tuple(axes or ())
        if sizes is not None:
            axes = tuple(a for a in axes if sizes.get(a, 1) > 1)
        if shape is not None and sizes is not None and axes:
            dim = int(shape[i])
            kept = axes
            while kept and dim % math.prod(sizes[a] for a in kept):
                kept = kept[:-1]
            if kept != axes:
                warnings.warn(
                    f"{what or 'array'} dim {i} ({names[i]!r}, size {dim}) is not divisible by mesh axes "
                    f"{axes} (sizes {[sizes[a] for a in axes]}); sharding it over {kept or 'nothing'} instead",
                    ShardingFallbackWarning, stacklevel=3)
            axes = kept
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec) or (
        isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x))


def _path_str(path: Any) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def logical_to_sharding(logical_specs_tree: Any, mesh: Mesh, rules: Rules | str,
                        shapes_tree: Any = None) -> Any:
    """Tree of logical specs (``nn.get_partition_spec`` output) → tree of :class:`NamedSharding`.

    ``shapes_tree`` (arrays or ``ShapeDtypeStruct`` with the same structure) enables the divisibility
    fallback.
    """
    rules = get_preset(rules)
    if shapes_tree is None:
        return jax.tree_util.tree_map_with_path(
            lambda p, s: NamedSharding(mesh, logical_to_pspec(s, rules, mesh, what=_path_str(p))),
            logical_specs_tree, is_leaf=_is_spec_leaf)
    specs_flat, treedef = jax.tree_util.tree_flatten_with_path(logical_specs_tree, is_leaf=_is_spec_leaf)
    shapes_flat = treedef.flatten_up_to(shapes_tree)
    out = [NamedSharding(mesh, logical_to_pspec(s, rules, mesh, shape=getattr(x, "shape", None),
                                                what=_path_str(p)))
           for (p, s), x in zip(specs_flat, shapes_flat, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, out)


def _is_boxed(x: Any) -> bool:
    return isinstance(x, nn.Partitioned)


def param_shardings(params_boxed: Any, mesh: Mesh, preset: Rules | str) -> Any:
    """Shardings (plain tree, matching ``nn.unbox(params_boxed)``) for boxed params or their abstract shapes
    (``jax.eval_shape(model.init, ...)``)."""
    specs = nn.get_partition_spec(params_boxed)
    shapes = nn.unbox(params_boxed)
    return logical_to_sharding(specs, mesh, preset, shapes)


def state_shardings(state: Any, params: Any, param_shardings_tree: Any, mesh: Mesh) -> Any:
    """Shardings for an optimizer state (arrays or abstract shapes) laid out like the parameters it mirrors.

    A state leaf whose key path ends with a parameter's key path and has that parameter's shape (Adam's ``mu`` /
    ``nu``, Muon's momentum: ``...mu['model']['layer']['kernel']``) takes the parameter's sharding from
    ``param_shardings_tree`` (a tree like ``params``); every other leaf (step counts, scalars, masked entries) is
    replicated on ``mesh``. Without this a jitted ``tx.init`` places every moment replicated: its zeros carry no
    data dependence on the sharded parameters for the compiler to follow."""
    by_path: dict[tuple, tuple[tuple[int, ...], Any]] = {}
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_shardings = jax.tree_util.tree_leaves(param_shardings_tree,
                                               is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(flat_params) != len(flat_shardings):
        raise ValueError(f"state_shardings: {len(flat_params)} parameters but {len(flat_shardings)} shardings")
    for (path, p), sh in zip(flat_params, flat_shardings, strict=True):
        by_path[tuple(path)] = (tuple(p.shape), sh)
    longest = max((len(k) for k in by_path), default=0)
    rep = NamedSharding(mesh, PartitionSpec())

    def one(path: tuple, leaf: Any) -> Any:
        shape = tuple(getattr(leaf, "shape", ()))
        for n in range(min(longest, len(path)), 0, -1):
            hit = by_path.get(tuple(path[-n:]))
            if hit is not None and hit[0] == shape:
                return hit[1]
        return rep

    return jax.tree_util.tree_map_with_path(one, state)


def shard_params(params_boxed: Any, mesh: Mesh, preset: Rules | str) -> Any:
    """Place boxed (``nn.LogicallyPartitioned``) params on ``mesh`` per ``preset``; returns plain arrays."""
    shardings = param_shardings(params_boxed, mesh, preset)
    return jax.device_put(nn.unbox(params_boxed), shardings)


def flax_rules(preset: Rules | str, mesh: Mesh | Mapping[str, int] | None = None) -> Rules:
    """Rules for ``nn.logical_axis_rules(...)``; with ``mesh``, mesh axes of size 1 / absent are removed (so a
    dimension is not constrained over axes that do nothing)."""
    rules = get_preset(preset)
    sizes = _mesh_sizes(mesh)
    if sizes is None:
        return rules
    out = []
    for name, axes in rules:
        kept = tuple(a for a in _axes_tuple(axes) if sizes.get(a, 1) > 1)
        out.append((name, None if not kept else kept[0] if len(kept) == 1 else kept))
    return tuple(out)


@contextlib.contextmanager
def activate(mesh: Mesh, preset: Rules | str) -> Iterator[Rules]:
    """Context: ``mesh`` as the current mesh and the preset's rules as flax's logical axis rules, so
    ``nn.with_logical_constraint`` inside the model (and :func:`with_logical_constraint`) take effect."""
    rules = flax_rules(preset, mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield rules


def input_mesh(tree: Any) -> Any:
    """The (abstract) mesh the array leaves of ``tree`` are laid out on, or ``None``.

    Inside ``jax.jit`` an argument given a :class:`NamedSharding` (``in_shardings`` or a committed input) has
    an aval whose ``sharding.mesh`` is that mesh's :class:`~jax.sharding.AbstractMesh`, even when no mesh
    context is active; the first non-empty one is returned (``None`` for single-device inputs).
    """
    for leaf in jax.tree_util.tree_leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and mesh.size > 1:
            return mesh
    return None


def on_input_mesh(fn: Any, preset: Rules | str = "train") -> Any:
    """Wrap a step function so it is always traced with a mesh and logical-axis rules active.

    With a mesh already active (``activate`` / ``jax.set_mesh``) ``fn`` runs as is. Otherwise, when its
    arguments live on a mesh (see :func:`input_mesh`), ``fn`` is traced under that mesh (as the current abstract
    mesh) and ``preset``'s rules. Without this, a step jitted with sharded ``in_shardings`` but *called* outside
    the mesh context traces the single-device model (no activation constraints, the non-expert-parallel MoE
    gathering ``expert``-sharded weights), which XLA's SPMD partitioner may fail to partition.
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not jax.sharding.get_abstract_mesh().empty:
            return fn(*args, **kwargs)
        mesh = input_mesh((args, kwargs))
        if mesh is None:
            return fn(*args, **kwargs)
        with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(flax_rules(preset, mesh)):
            return fn(*args, **kwargs)

    return wrapped


def with_logical_constraint(x: jax.Array, names: Sequence[str | None], rules: Rules | str | None = None,
                            mesh: Mesh | None = None) -> jax.Array:
    """Shape-aware sharding constraint for an activation from logical ``names``.

    Uses ``rules`` (default: the active flax rules) and ``mesh`` (default: the current mesh); a no-op when no
    rules or no mesh are active. Unlike flax's version, non-divisible dimensions fall back to fewer mesh axes.
    """
    if rules is None:
        rules = tuple(nn.get_logical_axis_rules())
    if not rules:
        return x
    if mesh is None:
        abstract = jax.sharding.get_abstract_mesh()
        if abstract.empty:
            return x
        spec = logical_to_pspec(names, rules, abstract, shape=x.shape)
        return jax.lax.with_sharding_constraint(x, spec)
    spec = logical_to_pspec(names, rules, mesh, shape=x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def replicated_params(params_boxed: Any, mesh: Mesh | Mapping[str, int], preset: Rules | str,
                      min_bytes: int = 1 << 20) -> list[tuple[str, tuple[int, ...], int]]:
    """Parameters larger than ``min_bytes`` that the preset leaves fully replicated on ``mesh`` (a Mesh or
    ``{axis: size}``; boxed arrays or abstract shapes): ``[(path, shape, bytes)]``."""
    rules = get_preset(preset)
    specs = nn.get_partition_spec(params_boxed)
    values = nn.unbox(params_boxed)
    flat_specs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec_leaf)[0]
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingFallbackWarning)
        for (path, names), v in zip(flat_specs, jax.tree_util.tree_leaves(values), strict=True):
            nbytes = math.prod(v.shape) * jax.numpy.dtype(v.dtype).itemsize
            spec = logical_to_pspec(names, rules, mesh, shape=v.shape)
            if nbytes > min_bytes and all(e is None for e in spec):
                out.append((_path_str(path), tuple(v.shape), nbytes))
    return out


#: Parameters a preset deliberately keeps replicated (path substrings), e.g. small projections whose
#: replication saves a collective per token in decode. Checked by tests; extend with :func:`register_preset`.
REPLICATED_OK: dict[str, tuple[str, ...]] = {
    "serve": ("block_sparse_moe/gate/kernel", "self_attn/q_a_proj", "self_attn/kv_a_proj_with_mqa",
              "self_attn/f_a_proj", "vision_tower/", "mm_projector/"),
}
