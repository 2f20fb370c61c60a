"""HF checkpoint directory <-> k3-jax parameters: index reading, ``verify``, streaming load, export.

A checkpoint directory holds ``config.json``, ``model.safetensors.index.json`` (``{"metadata":
{"total_size"}, "weight_map": {name: file}}``) and shards ``model-XXXXX-of-XXXXXX.safetensors``.
Every decision about names/shapes/dtypes comes from the table in :mod:`k3_jax.convert.names`.

Parameters are nested dicts of numpy arrays in the model's tree layout (:func:`k3_jax.model.layer_plan`):
layer ``l = seg.start + r * seg.period + j`` is slot ``r`` of ``params["model"]["segment_{s}"]["layer_{j}"]``.
Checkpoint dtypes are kept (bf16 stays bf16, the six fp32 kinds stay fp32; MXFP4 experts either stay packed
u8 or are dequantized to bf16).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from k3_jax.config import K3Config, config_from_dict
from k3_jax.convert import names as N
from k3_jax.convert.outdir import claim, publish_dir
from k3_jax.convert.safetensors_io import DTYPES, SafetensorsError, SafetensorsFile, SafetensorsWriter, read_header
from k3_jax.convert.transforms import pack_mxfp4_np, to_flax, to_hf, unpack_mxfp4_np
from k3_jax.convert.vision import vision_params_from_hf, vision_params_to_hf, vision_tensor_specs
from k3_jax.progress import Progress

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
PASSTHROUGH = (
    "generation_config.json", "tokenizer_config.json", "tokenization_kimi.py", "tiktoken.model",
    "preprocessor_config.json", "configuration_kimi_k3.py", "kimi_k3_processor.py",
    "kimi_k3_vision_processing.py", "media_utils.py", "encoding_k3.py", "LICENSE",
    "modeling_kimi_k3.py", "modeling_kimi_linear.py", "chat_template.jinja", "special_tokens_map.json",
)  # fmt: skip


class CheckpointError(ValueError):
    """The checkpoint does not match what the config/table expects; the message names file and tensor."""


# ------------------------------------------------------------------------------------------------ index
@dataclass
class Index:
    root: str
    source: str
    weight_map: dict[str, str]
    total_size: int | None


def read_index(path: str | os.PathLike[str]) -> Index:
    """Read ``model.safetensors.index.json`` (plain or ``.gz``) from a file or directory; a directory with a
    single ``model.safetensors`` and no index is accepted (its header is the index)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for cand in (INDEX_NAME, INDEX_NAME + ".gz"):
            if os.path.exists(os.path.join(path, cand)):
                return read_index(os.path.join(path, cand))
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(single):
            infos, _, _ = read_header(single)
            wm = {n: "model.safetensors" for n in infos}
            return Index(path, single, wm, sum(i.nbytes for i in infos.values()))
        raise CheckpointError(f"{path}: no {INDEX_NAME} and no model.safetensors")
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: index file does not exist")
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            raw = json.load(f)
        wm = raw["weight_map"]
        total = raw.get("metadata", {}).get("total_size")
    except (json.JSONDecodeError, OSError, KeyError, AttributeError, TypeError) as e:
        raise CheckpointError(f"{path}: not a safetensors index ({type(e).__name__}: {e})") from None
    return Index(os.path.dirname(os.path.abspath(path)), path, dict(wm), None if total is None else int(total))


def read_raw_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: config.json does not exist") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None


# -------------------------------------------------------------------------------------- expected tensors
def _rule_bytes(rule: N.Rule, sym: Mapping[str, int]) -> int:
    return int(np.prod(N.hf_shape(rule, sym), dtype=np.int64)) * DTYPES[rule.dtype].itemsize


def expected_tensors(cfg: K3Config, fmt: str) -> dict[str, N.Resolved]:
    """Canonical name -> :class:`~k3_jax.convert.names.Resolved` for every text tensor (table order)."""
    return dict(N.expected_text_names(cfg, fmt))


def _expected_sizes(cfg: K3Config, fmt: str) -> dict[str, int]:
    """Canonical name -> byte size, fast (string formatting only; used by :func:`verify` on 497k names)."""
    sym = N.dims(cfg)
    out: dict[str, int] = {}
    pre = N.CANONICAL_PREFIX
    xr = [(r.pattern, _rule_bytes(r, sym)) for r in N.TEXT_RULES if r.scope == "expert" and r.fmt == fmt]
    for layer in range(cfg.num_hidden_layers):
        for r in N.TEXT_RULES:
            if r.scope not in ("top", "expert") and N.rule_applies(r, cfg, layer, fmt):
                out[pre + r.pattern.replace("{l}", str(layer))] = _rule_bytes(r, sym)
        if cfg.ffn_kind(layer) == "moe":
            for pat, nb in xr:
                head, tail = pat.replace("{l}", str(layer)).split("{e}")
                for e in range(cfg.num_experts):
                    out[f"{pre}{head}{e}{tail}"] = nb
    for r in N.TEXT_RULES:
        if r.scope == "top":
            out[pre + r.pattern] = _rule_bytes(r, sym)
    return out


def canonical(name: str) -> str:
    """Rewrite an accepted prefix variant to ``language_model.model.…`` / ``language_model.lm_head…``."""
    if name.startswith(("language_model.model.", "language_model.lm_head.", "vision_tower.", "mm_projector.")):
        return name
    body = name[len(N.CANONICAL_PREFIX) :] if name.startswith(N.CANONICAL_PREFIX) else name
    if body.startswith("lm_head."):
        return N.CANONICAL_PREFIX + body
    if not body.startswith("model."):
        body = "model." + body
    return N.CANONICAL_PREFIX + body


def _vision_expect(name: str, vsym: Mapping[str, int]) -> tuple[str, tuple[int, ...]]:
    tmpl, nums = N._template(name)
    rule = N._VISION[tmpl][0]
    return rule.dtype, N.hf_shape(rule, vsym, nums[0] if nums else None)


def checkpoint_format(raw_config: Mapping[str, Any]) -> str:
    text = raw_config.get("text_config", raw_config)
    return "mxfp4" if (text.get("quantization_config") or raw_config.get("quantization_config")) else "bf16"


# --------------------------------------------------------------------------------------------- verify
@dataclass
class VerifyReport:
    mapped: int = 0
    vision: int = 0
    unknown: int = 0
    bytes: int = 0
    declared: int | None = None
    files_checked: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def summary(self) -> str:
        return (
            f"mapped={self.mapped} vision={self.vision} unknown={self.unknown} bytes={self.bytes} "
            f"declared={self.declared}"
        )


def verify(
    path: str | os.PathLike[str],
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    check_files: bool = True,
    max_errors: int = 20,
) -> VerifyReport:
    """Check a checkpoint (directory or bare index file) against a config without reading tensor data.

    Every index name must map to a tensor of the config (either prefix) or be a recognised vision tensor;
    every expected tensor must be present; the sum of expected sizes must equal ``total_size``. When the
    shards are there (``check_files``), each shard must exist and its header must hold exactly the tensors
    the index assigns to it, with the expected dtype and shape, and header sizes must sum to ``total_size``.
    """
    idx = read_index(path)
    if config is None:
        raw = read_raw_config(idx.root)
        cfg_src = os.path.join(idx.root, "config.json")
    elif isinstance(config, Mapping):
        raw, cfg_src = dict(config), "<config>"
    else:
        raw, cfg_src = read_raw_config(config), os.fspath(config)
    try:
        cfg = config_from_dict(raw)
    except ValueError as e:
        raise CheckpointError(f"{cfg_src}: {e}") from None
    fmt = checkpoint_format(raw)
    vsym = N.vision_dims(raw.get("vision_config"), cfg.hidden_size)
    rep = VerifyReport(declared=idx.total_size)

    def err(msg: str) -> None:
        if len(rep.errors) < max_errors:
            rep.errors.append(msg)
        elif len(rep.errors) == max_errors:
            rep.errors.append("… (more errors suppressed)")

    expected = _expected_sizes(cfg, fmt)
    if cfg.vision is not None:  # the config's vision tower: expected and mapped like the text tensors
        expected.update({n: int(np.prod(sh, dtype=np.int64)) * DTYPES[dt].itemsize
                         for n, (dt, sh) in vision_tensor_specs(cfg.vision).items()})
    seen: dict[str, str] = {}  # canonical -> original
    for name in idx.weight_map:
        c = canonical(name)
        nb = expected.get(c)
        if nb is not None:
            if c in seen:
                err(f"{idx.source}: tensor {name!r} duplicates {seen[c]!r}")
            seen[c] = name
            rep.mapped += 1
            rep.bytes += nb
            continue
        res = N.resolve(name)
        if res == "vision":
            rep.vision += 1
            dt, shape = _vision_expect(name, vsym)
            rep.bytes += int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
            continue
        rep.unknown += 1
        if isinstance(res, N.Resolved):
            err(
                f"{idx.source}: unexpected tensor {name!r}: the pattern {res.rule.pattern!r} does not exist "
                f"for this config ({cfg_src}: layer {res.layer} is {_kind(cfg, res.layer)}, "
                f"expert format {fmt}, {cfg.num_experts} experts)"
            )
        else:
            err(f"{idx.source}: unknown tensor {name!r} (no rule in k3_jax.convert.names matches it)")
    missing = [n for n in expected if n not in seen]
    for n in missing[:5]:
        err(f"{idx.source}: missing tensor {n!r} (expected by {cfg_src}, format {fmt})")
    if len(missing) > 5:
        err(f"{idx.source}: {len(missing)} expected tensors missing in all")
    if idx.total_size is not None and rep.bytes != idx.total_size and not rep.unknown and not missing:
        err(f"{idx.source}: sum of tensor sizes {rep.bytes} != declared total_size {idx.total_size}")

    if check_files and (os.path.isdir(path) or _any_shard_exists(idx)):
        _verify_files(idx, cfg, fmt, vsym, rep, err)
    return rep


def _kind(cfg: K3Config, layer: int | None) -> str:
    if layer is None or not 0 <= layer < cfg.num_hidden_layers:
        return f"out of range (num_hidden_layers={cfg.num_hidden_layers})"
    return f"{cfg.mixer_kind(layer)}/{cfg.ffn_kind(layer)}"


def _any_shard_exists(idx: Index) -> bool:
    return any(os.path.exists(os.path.join(idx.root, f)) for f in set(idx.weight_map.values()))


def _verify_files(idx: Index, cfg: K3Config, fmt: str, vsym, rep: VerifyReport, err) -> None:
    by_file: dict[str, list[str]] = {}
    for name, f in idx.weight_map.items():
        by_file.setdefault(f, []).append(name)
    sym = N.dims(cfg)
    header_bytes = 0
    tensors = 0
    prog = Progress("verify", idx.total_size, unit="B")
    for i, fname in enumerate(sorted(by_file), 1):
        fpath = os.path.join(idx.root, fname)
        tensors += len(by_file[fname])
        if not os.path.exists(fpath):
            err(f"{idx.source}: names file {fname!r} (tensor {by_file[fname][0]!r}, …) which does not exist")
            continue
        try:
            infos, _, _ = read_header(fpath)
        except SafetensorsError as e:
            err(str(e))
            continue
        prog.update(sum(info.nbytes for info in infos.values()), shards=f"{i}/{len(by_file)}",
                    tensors=f"{tensors}/{len(idx.weight_map)}", errors=len(rep.errors))
        rep.files_checked += 1
        listed = set(by_file[fname])
        for name in listed - set(infos):
            err(f"{fpath}: tensor {name!r} is listed in the index for this file but not in its header")
        for name, info in infos.items():
            header_bytes += info.nbytes
            if name not in listed:
                err(f"{fpath}: tensor {name!r} is in the header but the index does not assign it to this file")
                continue
            res = N.resolve(name, cfg, fmt)
            if res == "vision":
                dt, shape = _vision_expect(name, vsym)
            elif isinstance(res, N.Resolved):
                dt, shape = res.rule.dtype, N.hf_shape(res.rule, sym)
            else:
                continue  # already reported from the index
            if info.dtype != dt or info.shape != shape:
                err(f"{fpath}: tensor {name!r}: expected {dt}{list(shape)}, header has {info.dtype}{list(info.shape)}")
    prog.close()
    if idx.total_size is not None and header_bytes != idx.total_size and rep.files_checked == len(by_file):
        err(f"{idx.source}: shard headers hold {header_bytes} bytes, index declares total_size {idx.total_size}")


# ----------------------------------------------------------------------------------------- tree layout
def layer_slots(cfg: K3Config) -> dict[int, tuple[str, str, int, int]]:
    """layer -> (segment key, layer key, repeat index r, repeats) following :func:`k3_jax.model.layer_plan`."""
    from k3_jax.model import layer_plan

    out = {}
    for s, seg in enumerate(layer_plan(cfg)):
        for r in range(seg.repeats):
            for j in range(seg.period):
                out[seg.layer(r, j)] = (f"segment_{s}", f"layer_{j}", r, seg.repeats)
    return out


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = tree
    for k in path:
        node = node[k]
    return node


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = tree
    for k in path[:-1]:
        node = node.setdefault(k, {})
    node[path[-1]] = value


def param_shapes(cfg: K3Config, experts: str | None = None) -> dict[str, Any]:
    """The parameter tree the table implies: ``jax.ShapeDtypeStruct`` leaves in checkpoint dtypes
    (bf16 / fp32; MXFP4 experts u8). Must equal the model's ``init`` tree (tested with ``jax.eval_shape``)."""
    import jax

    experts = experts or cfg.expert_format
    sym = N.dims(cfg)
    slots = layer_slots(cfg)
    tree: dict[str, Any] = {}
    for _, res in N.expected_text_names(cfg, experts):
        if res.rule.scope == "expert" and res.expert:
            continue
        shape = N.flax_shape(res.rule, sym)
        path, r = param_path(slots, res)
        if r is not None:
            shape = (slots[res.layer][3], *shape)
        _set(tree, path, jax.ShapeDtypeStruct(shape, DTYPES[res.rule.dtype]))
    return tree


def param_path(
    cfg_slots: Mapping[int, tuple[str, str, int, int]], res: N.Resolved
) -> tuple[tuple[str, ...], int | None]:
    """Full tree path of the leaf a resolved tensor fills, and its stacked index (None for top-level)."""
    if res.layer is None:
        return res.rule.param, None
    seg, lay, r, _ = cfg_slots[res.layer]
    return ("model", seg, lay, *res.rule.param), r


# ------------------------------------------------------------------------------------------- streaming
class ShardReader:
    """Opens shards lazily and reads one tensor at a time, checking dtype/shape against the table."""

    def __init__(self, idx: Index):
        self.idx = idx
        self._open: dict[str, SafetensorsFile] = {}
        self._canon = {canonical(n): n for n in idx.weight_map}
        self.bytes_read = 0  # tensor bytes returned by get() so far (progress reports)
        self.tensors_read = 0

    def get(self, canon_name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        name = self._canon.get(canon_name)
        if name is None:
            raise CheckpointError(f"{self.idx.source}: missing tensor {canon_name!r}")
        fname = self.idx.weight_map[name]
        f = self._open.get(fname)
        if f is None:
            fpath = os.path.join(self.idx.root, fname)
            if not os.path.exists(fpath):
                raise CheckpointError(f"{self.idx.source}: names file {fname!r} (for {name!r}) which does not exist")
            f = self._open[fname] = SafetensorsFile(fpath)
        info = f.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{f.path}: tensor {name!r} (listed in the index) is not in this file")
        if info.dtype != dtype or info.shape != tuple(shape):
            raise CheckpointError(
                f"{f.path}: tensor {name!r}: expected {dtype}{list(shape)}, got {info.dtype}{list(info.shape)}"
            )
        self.bytes_read += info.nbytes
        self.tensors_read += 1
        return f.get(name)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def iter_layer_values(
    reader: ShardReader, cfg: K3Config, fmt: str, experts: str
) -> Iterator[tuple[int | None, dict[tuple[str, ...], np.ndarray]]]:
    """Yield ``(layer, {path inside the layer: value})`` for every layer, then ``(None, top-level values)``.

    Experts of a layer are stacked over E as they are read; nothing beyond one layer's output is held.
    """
    sym = N.dims(cfg)
    grouped: dict[int | None, list[N.Resolved]] = {}
    for _, res in N.expected_text_names(cfg, fmt):
        grouped.setdefault(res.layer, []).append(res)
    for layer, items in grouped.items():
        vals: dict[tuple[str, ...], np.ndarray] = {}
        for res in items:
            rule = res.rule
            shape = N.hf_shape(rule, sym)
            if rule.scope == "expert" and fmt != experts:
                if fmt == "mxfp4" and rule.param[-1] == "weight_scale":
                    continue  # consumed with its weight_packed
                if fmt == "mxfp4":
                    scale_name = res.name.replace("weight_packed", "weight_scale")
                    scale_rule = next(r for r in N.TEXT_RULES if r.pattern == rule.pattern.replace("packed", "scale"))
                    packed = reader.get(res.name, rule.dtype, shape)
                    scale = reader.get(scale_name, scale_rule.dtype, N.hf_shape(scale_rule, sym))
                    w = unpack_mxfp4_np(packed, scale).astype(ml_dtypes.bfloat16)  # [out, in]
                    _put_expert(vals, rule.param[:-1], res.expert, np.ascontiguousarray(w.T), sym)
                else:
                    w = reader.get(res.name, rule.dtype, shape)  # bf16 [out, in]
                    p, s = pack_mxfp4_np(w.astype(np.float32))
                    _put_expert(vals, (*rule.param, "weight_packed"), res.expert, p, sym)
                    _put_expert(vals, (*rule.param, "weight_scale"), res.expert, s, sym)
                continue
            x = reader.get(res.name, rule.dtype, shape)
            y = to_flax(rule, x, sym, res.name)
            if rule.scope == "expert":
                _put_expert(vals, rule.param, res.expert, y, sym)
            else:
                vals[rule.param] = y
        yield layer, vals


def _put_expert(vals, path, e, y, sym) -> None:
    buf = vals.get(path)
    if buf is None:
        buf = vals[path] = np.empty((sym["E"], *y.shape), y.dtype)
    buf[e] = y


def _prepare(hf_dir) -> tuple[Index, dict[str, Any], K3Config, str]:
    idx = read_index(hf_dir)
    raw = read_raw_config(idx.root)
    rep = verify(hf_dir)
    if not rep.ok:
        raise CheckpointError(
            f"{hf_dir}: checkpoint failed verification ({len(rep.errors)} problem(s)):\n  " + "\n  ".join(rep.errors)
        )
    if rep.vision:
        log.warning("ignored %d vision tensors: config.json has no vision_config", rep.vision)
    cfg = config_from_dict(raw)
    return idx, raw, cfg, checkpoint_format(raw)


def load_checkpoint(
    hf_dir: str | os.PathLike[str], *, experts: str | None = None, vision: bool = True, **config_overrides: Any
) -> tuple[K3Config, dict[str, Any]]:
    """Load an HF checkpoint directory into ``(cfg, params)`` ready for ``K3ForCausalLM(cfg).apply``.

    Args:
      hf_dir: directory with ``config.json`` + index + shards (verified first; any mismatch raises
        :class:`CheckpointError` naming file and tensor).
      experts: ``"bf16"`` (dequantize MXFP4 experts) or ``"mxfp4"`` (keep them packed: ``weight_packed`` /
        ``weight_scale`` u8 leaves); default = the checkpoint's own format.
      vision: also load ``vision_tower`` / ``mm_projector`` (when the config has a ``vision_config``), as
        top-level keys beside ``model`` / ``lm_head`` (the tree of ``K3ForConditionalGeneration``, which
        ``K3ForCausalLM`` also takes); ``False`` loads the text model only and returns ``cfg.vision = None``.
      config_overrides: runtime fields for the returned config (``dtype=…``).
    Returns:
      ``cfg`` (with ``expert_format=experts``) and nested dicts of numpy arrays (checkpoint dtypes).
    """
    idx, _, cfg, fmt = _prepare(hf_dir)
    experts = experts or fmt
    if experts not in ("bf16", "mxfp4"):
        raise ValueError(f"experts must be 'bf16' or 'mxfp4', got {experts!r}")
    cfg = cfg.replace(expert_format=experts, **config_overrides)
    slots = layer_slots(cfg)
    params: dict[str, Any] = {}
    reader = ShardReader(idx)
    sizes = _expected_sizes(cfg, fmt)
    prog = Progress("load", sum(sizes.values()), unit="B")
    try:
        for layer, vals in iter_layer_values(reader, cfg, fmt, experts):
            prog.set(reader.bytes_read, tensors=f"{reader.tensors_read}/{len(sizes)}",
                     layer="top" if layer is None else f"{layer}/{cfg.num_hidden_layers}")
            for p, v in vals.items():
                if layer is None:
                    _set(params, p, v)
                    continue
                seg, lay, r, reps = slots[layer]
                full = ("model", seg, lay, *p)
                try:
                    buf = _get(params, full)
                except KeyError:
                    buf = np.empty((reps, *v.shape), v.dtype)
                    _set(params, full, buf)
                buf[r] = v
        if vision and cfg.vision is not None:
            specs = vision_tensor_specs(cfg.vision)
            params.update(vision_params_from_hf(lambda n: reader.get(n, *specs[n]), cfg.vision))
        prog.close()
    finally:
        reader.close()
    if not vision:
        cfg = cfg.replace(vision=None)
    return cfg, params


# --------------------------------------------------------------------------------------------- export
def _params_expert_format(cfg: K3Config, params: Mapping[str, Any]) -> str:
    for seg in params["model"].values():
        if isinstance(seg, Mapping):
            for lay in seg.values():
                if isinstance(lay, Mapping) and "block_sparse_moe" in lay:
                    return "mxfp4" if isinstance(lay["block_sparse_moe"]["experts"]["w1"], Mapping) else "bf16"
    return cfg.expert_format


def hf_tensor_fn(cfg: K3Config, params: Mapping[str, Any], fmt_out: str) -> Callable[[N.Resolved], np.ndarray]:
    """A function producing one checkpoint tensor (format ``fmt_out``) from in-memory params."""
    sym = N.dims(cfg)
    slots = layer_slots(cfg)
    held = _params_expert_format(cfg, params)
    cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def leaf(res: N.Resolved, path: tuple[str, ...]) -> np.ndarray:
        if res.layer is None:
            return np.asarray(_get(params, path))
        seg, lay, r, _ = slots[res.layer]
        return np.asarray(_get(params, ("model", seg, lay, *path))[r])

    def produce(res: N.Resolved) -> np.ndarray:
        rule = res.rule
        want = DTYPES[rule.dtype]
        if rule.scope == "expert" and held != fmt_out:
            if fmt_out == "bf16":  # packed params -> dequantized tensor [out, in]
                p = leaf(res, (*rule.param, "weight_packed"))[res.expert]
                s = leaf(res, (*rule.param, "weight_scale"))[res.expert]
                return unpack_mxfp4_np(p, s).astype(want)
            key = (res.layer, res.expert, rule.param[:-1])
            if key not in cache:
                cache.clear()
                w = leaf(res, rule.param[:-1])[res.expert]  # [in, out]
                cache[key] = pack_mxfp4_np(np.asarray(w, np.float32).T)
            return cache[key][0 if rule.param[-1] == "weight_packed" else 1]
        y = leaf(res, rule.param)
        if rule.scope == "expert":
            y = y[res.expert]
        return np.asarray(to_hf(rule, y, sym, res.name)).astype(want, copy=False)

    return produce


def shard_plan(
    entries: list[tuple[str, N.Resolved]], sym: Mapping[str, int], max_shard_bytes: int
) -> list[list[tuple[str, N.Resolved]]]:
    """Greedy split of the (layer-ordered) tensor list into shards of at most ``max_shard_bytes``."""
    shards: list[list[tuple[str, N.Resolved]]] = [[]]
    size = 0
    for name, res in entries:
        nb = _rule_bytes(res.rule, sym)
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, res))
        size += nb
    return shards


def shard_name(i: int, n: int) -> str:
    """Released naming: 5-digit index, 6-digit total (``model-00001-of-000096.safetensors``)."""
    return f"model-{i:05d}-of-{n:06d}.safetensors"


def save_checkpoint(
    cfg: K3Config,
    params: Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    *,
    experts: str | None = None,
    max_shard_bytes: int = 5 << 30,
    source_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
) -> str:
    """Export params to the released HF layout (bf16 or MXFP4 experts), atomically.

    Writes into ``<out_dir>.partial-<pid>``, verifies it (tensor count, shapes, dtypes, sizes) and renames it
    to ``out_dir`` only when complete. ``source_dir`` supplies ``config.json`` extras (vision config …) and
    the tokenizer/processor files, copied verbatim. Returns ``out_dir``.
    """
    fmt_out = experts or _params_expert_format(cfg, params)
    if fmt_out not in ("bf16", "mxfp4"):
        raise ValueError(f"experts must be 'bf16' or 'mxfp4', got {fmt_out!r}")
    out_dir, tmp = claim(out_dir, overwrite)
    try:
        out_cfg = cfg.replace(expert_format=fmt_out)
        raw = out_cfg.to_hf_dict()
        if source_dir is not None:
            raw = _merge_source_config(read_raw_config(source_dir), raw, fmt_out)
            for f in PASSTHROUGH:
                src = os.path.join(os.fspath(source_dir), f)
                if os.path.exists(src):
                    shutil.copy2(src, os.path.join(tmp, f))
        has_vision = cfg.vision is not None and "vision_tower" in params
        if not has_vision:
            raw.pop("vision_config", None)  # a text-only export: no tower tensors, so no vision_config
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)
        sym = N.dims(cfg)
        entries = list(N.expected_text_names(cfg, fmt_out))
        produce = hf_tensor_fn(cfg, params, fmt_out)
        shards = shard_plan(entries, sym, max_shard_bytes)
        n_files = len(shards) + int(has_vision)
        weight_map: dict[str, str] = {}
        total = 0
        prog = Progress("export", sum(_rule_bytes(r.rule, sym) for _, r in entries), unit="B")
        for i, shard in enumerate(shards, 1):
            fname = shard_name(i, n_files)
            by_name = dict(shard)
            plan = [(n, r.rule.dtype, N.hf_shape(r.rule, sym)) for n, r in shard]
            with SafetensorsWriter(os.path.join(tmp, fname), plan, {"format": "pt"}) as w:
                for n, _, _ in w.order:
                    w.write(n, produce(by_name[n]))
                    prog.update(_rule_bytes(by_name[n].rule, sym), tensors=f"{len(weight_map) + 1}/{len(entries)}",
                                shard=f"{i}/{len(shards)}", layer=_layer_field(by_name[n]))
                    weight_map[n] = fname
            for _, r in shard:
                total += _rule_bytes(r.rule, sym)
        if has_vision:  # the tower and projector in one last shard
            fname = shard_name(n_files, n_files)
            specs = vision_tensor_specs(cfg.vision)
            tensors = dict(vision_params_to_hf(params, cfg.vision))
            with SafetensorsWriter(os.path.join(tmp, fname), [(n, *specs[n]) for n in tensors], {"format": "pt"}) as w:
                for n, _, _ in w.order:
                    w.write(n, tensors[n].astype(DTYPES[specs[n][0]], copy=False))
            for n, (dt, sh) in specs.items():
                weight_map[n] = fname
                total += int(np.prod(sh, dtype=np.int64)) * DTYPES[dt].itemsize
        prog.close()
        with open(os.path.join(tmp, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        rep = verify(tmp)
        if not rep.ok:
            raise CheckpointError(f"{tmp}: export failed verification:\n  " + "\n  ".join(rep.errors))
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _layer_field(res: N.Resolved) -> str:
    return "top" if res.layer is None else str(res.layer)


def _merge_source_config(src: dict[str, Any], ours: dict[str, Any], fmt_out: str) -> dict[str, Any]:
    """Keep the source config (vision etc.), update only the expert format's ``quantization_config``."""
    out = json.loads(json.dumps(src))
    text = out.get("text_config", out)
    if fmt_out == "mxfp4":
        text["quantization_config"] = ours["text_config"]["quantization_config"]
    else:
        text.pop("quantization_config", None)
        out.pop("quantization_config", None)
    return out


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    return fn(), time.perf_counter() - t
