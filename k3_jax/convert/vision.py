"""Vision tensors (``vision_tower.*``, ``mm_projector.*``) <-> the ``vision_tower`` / ``mm_projector`` parameter trees.

Driven by :data:`k3_jax.convert.names.VISION_RULES`; per-block tensors (``encoder.blocks.{l}``) stack into the
scanned ``[L, ...]`` leaves of :mod:`k3_jax.vision.tower`. numpy on the host, one tensor at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from k3_jax.convert import names as N
from k3_jax.convert.transforms import to_flax, to_hf
from k3_jax.vision.config import VisionConfig


def vision_symbols(v: VisionConfig) -> dict[str, int]:
    return N.vision_dims(v.to_hf_dict(), v.text_hidden_size)


def _layers(rule: N.Rule, v: VisionConfig) -> list[int | None]:
    if rule.scope == "vision_block":
        return list(range(v.vt_num_hidden_layers))
    if "{l}" in rule.pattern:  # mm_projector.proj.{0,2}: the Sequential's Linear indices
        return [0, 2]
    return [None]


def expected_vision_names(v: VisionConfig) -> Iterator[tuple[str, N.Rule, int | None]]:
    """Every vision tensor a checkpoint with ``v`` holds: ``(name, rule, layer)`` (168 for the release)."""
    for rule in N.VISION_RULES:
        for layer in _layers(rule, v):
            name = rule.pattern if layer is None else rule.pattern.replace("{l}", str(layer))
            yield name, rule, layer


def _param_path(rule: N.Rule, layer: int | None) -> tuple[str, ...]:
    if rule.scope == "vision_block" or layer is None:
        return rule.param
    return tuple(p.replace("{l}", str(layer)) for p in rule.param)


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def vision_params_from_hf(get: Callable[[str], np.ndarray], v: VisionConfig,
                          dtype: Any = None) -> dict[str, Any]:
    """``{"vision_tower": ..., "mm_projector": ...}`` from ``get(hf_name) -> array`` (HF shapes checked).

    ``dtype`` casts every leaf (None keeps the checkpoint's). Raises ``ValueError`` naming a tensor whose shape
    is not the one ``v`` implies.
    """
    sym = vision_symbols(v)
    out: dict[str, Any] = {}
    stacks: dict[tuple[str, ...], list[np.ndarray | None]] = {}
    for name, rule, layer in expected_vision_names(v):
        x = np.asarray(get(name))
        want = N.hf_shape(rule, sym, layer)
        if tuple(x.shape) != want:
            raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {want} from vision_config")
        y = to_flax(rule, x, sym, name)
        if dtype is not None:
            y = y.astype(dtype)
        path = _param_path(rule, layer)
        if rule.scope == "vision_block":
            stacks.setdefault(path, [None] * v.vt_num_hidden_layers)[layer] = y
        else:
            _set(out, path, y)
    for path, ys in stacks.items():
        _set(out, path, np.stack(ys))
    return out


def vision_params_to_hf(params: Mapping[str, Any], v: VisionConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Inverse of :func:`vision_params_from_hf`: ``(hf_name, HF-layout array)`` in checkpoint order."""
    sym = vision_symbols(v)
    for name, rule, layer in expected_vision_names(v):
        y = np.asarray(_get(params, _param_path(rule, layer)))
        if rule.scope == "vision_block":
            y = y[layer]
        yield name, to_hf(rule, y, sym, name)


def vision_param_shapes(v: VisionConfig) -> dict[str, Any]:
    """Flax shapes of the vision leaves (nested like the params), from the table alone."""
    sym = vision_symbols(v)
    out: dict[str, Any] = {}
    for _name, rule, layer in expected_vision_names(v):
        hf = N.hf_shape(rule, sym, layer)
        flax = to_flax(rule, np.zeros(hf, np.uint8), sym).shape if rule.transform != "identity" else hf
        if rule.scope == "vision_block":
            flax = (v.vt_num_hidden_layers, *flax)
        _set(out, _param_path(rule, layer), tuple(flax))
    return out


def vision_tensor_specs(v: VisionConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Checkpoint name -> (safetensors dtype, HF shape) of every vision tensor ``v`` implies."""
    sym = vision_symbols(v)
    return {name: (rule.dtype, N.hf_shape(rule, sym, layer)) for name, rule, layer in expected_vision_names(v)}
