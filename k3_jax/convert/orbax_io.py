"""HF checkpoint -> orbax (OCDBT) checkpoint, streamed layer by layer with bounded memory.

The output is what ``orbax.checkpoint.StandardCheckpointer().save(path, params)`` writes (zarr v2 arrays in
an OCDBT key-value store, keys ``"model.segment_0.layer_0.self_attn.q_proj.kernel"``, plus ``_METADATA`` /
``_CHECKPOINT_METADATA``), so :func:`restore_params` (or orbax directly) reads it back, optionally straight
onto a target sharding. The difference is how it is written: each stacked-over-layers leaf is created with
one chunk per layer slot (per expert for expert leaves) and filled slot by slot as the streaming reader
finishes a layer, so peak memory is one layer's output plus one tensor — never a shard, never the model.

Atomicity: everything goes to ``<out>.partial-<pid>``; after the last write the store is re-opened and
every array's shape/dtype and the tensor count are checked, then the directory is renamed to ``out``. The
output path is checked before the input is read, and leftovers of killed runs are swept first
(:mod:`k3_jax.convert.outdir`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import numpy as np

from k3_jax.convert.hf import (
    ShardReader,
    _expected_sizes,
    _prepare,
    iter_layer_values,
    layer_slots,
    param_shapes,
)
from k3_jax.convert.outdir import check_output, claim, publish_dir
from k3_jax.progress import Progress


def _zarr_dtype(dt: np.dtype) -> str:
    return "bfloat16" if dt.name == "bfloat16" else dt.str


def _walk(tree: Any, path: tuple[str, ...] = ()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _walk(v, (*path, k))
    else:
        yield path, tree


def convert_to_orbax(
    hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, experts: str | None = None,
    overwrite: bool = False, compression: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Convert an HF checkpoint directory to an orbax OCDBT checkpoint of k3-jax params.

    The input is fully verified (index, every shard header, shapes, dtypes, sizes) before anything is
    written. ``compression``: ``None`` (default; weights barely compress and zstd costs host time) or
    ``"zstd"`` (orbax's default). Returns stats ``{"tensors", "bytes_read", "seconds", "config"}``.
    """
    import tensorstore as ts

    t0 = time.perf_counter()
    if experts not in (None, "bf16", "mxfp4"):
        raise ValueError(f"experts must be 'bf16' or 'mxfp4', got {experts!r}")
    out_dir = check_output(out_dir, overwrite)  # before the input is read
    idx, raw, cfg, fmt = _prepare(hf_dir)
    experts = experts or fmt
    cfg = cfg.replace(expert_format=experts)
    out_dir, tmp = claim(out_dir, overwrite)
    shapes = param_shapes(cfg, experts)
    slots = layer_slots(cfg)
    reader = ShardReader(idx)
    ctx = ts.Context({"file_io_concurrency": {"limit": 8}})
    kvstore = {"driver": "ocdbt", "base": f"file://{tmp}"}
    arrays: dict[tuple[str, ...], Any] = {}
    sizes = _expected_sizes(cfg, fmt)
    prog = Progress("convert", sum(sizes.values()), unit="B")
    try:
        for path, sds in _walk(shapes):
            shape = tuple(sds.shape)
            stacked = path[0] == "model" and path[1].startswith("segment_")
            chunks = list(shape)
            if stacked:
                chunks[0] = 1
                if "experts" in path and len(shape) >= 3:
                    chunks[1] = 1
            spec = {
                "driver": "zarr",
                "kvstore": {**kvstore, "path": ".".join(path) + "/"},
                "metadata": {
                    "shape": list(shape),
                    "chunks": chunks,
                    "dtype": _zarr_dtype(np.dtype(sds.dtype)),
                    "compressor": {"id": "zstd", "level": 1} if compression == "zstd" else None,
                    "dimension_separator": ".",
                },
                "create": True,
                "delete_existing": True,
            }
            arrays[path] = ts.open(spec, context=ctx).result()
        written = 0
        for layer, vals in iter_layer_values(reader, cfg, fmt, experts):
            for p, v in vals.items():
                if layer is None:
                    arrays[p].write(v).result()
                else:
                    seg, lay, r, _ = slots[layer]
                    arrays[("model", seg, lay, *p)][r].write(v).result()
                written += 1
            prog.set(reader.bytes_read, tensors=f"{reader.tensors_read}/{len(sizes)}",
                     layer="top" if layer is None else f"{layer}/{cfg.num_hidden_layers}")
            del vals
        prog.close()
        _write_metadata(tmp, shapes)
        # re-open and check before publishing
        for path, sds in _walk(shapes):
            a = ts.open({"driver": "zarr", "kvstore": {**kvstore, "path": ".".join(path) + "/"}}, context=ctx).result()
            if tuple(a.shape) != tuple(sds.shape) or a.dtype.numpy_dtype != np.dtype(sds.dtype):
                raise RuntimeError(f"{tmp}: array {'.'.join(path)} came back as {a.dtype}{a.shape}")
        arrays.clear()
        with open(os.path.join(tmp, "k3_config.json"), "w") as f:
            json.dump(cfg.to_hf_dict(), f, indent=2)
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.close()
    return {
        "tensors": sum(1 for _ in _walk(shapes)),
        "bytes_read": idx.total_size,
        "seconds": time.perf_counter() - t0,
        "config": cfg,
    }


def _write_metadata(root: str, shapes: dict[str, Any]) -> None:
    tree_md = {}
    for path, _ in _walk(shapes):
        tree_md[str(tuple(path))] = {
            "key_metadata": [{"key": k, "key_type": 2} for k in path],
            "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False},
        }
    md = {
        "tree_metadata": tree_md,
        "use_ocdbt": True,
        "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    with open(os.path.join(root, "_METADATA"), "w") as f:
        json.dump(md, f)
    now = time.time_ns()
    with open(os.path.join(root, "_CHECKPOINT_METADATA"), "w") as f:
        json.dump(
            {
                "item_handlers": "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler",
                "metrics": {},
                "performance_metrics": {},
                "init_timestamp_nsecs": now,
                "commit_timestamp_nsecs": now,
                "custom_metadata": {},
            },
            f,
        )


def restore_params(path: str | os.PathLike[str], target: Any | None = None) -> Any:
    """Read a converted checkpoint with orbax. ``target``: optional tree of ``jax.ShapeDtypeStruct`` with
    ``sharding`` set (e.g. from ``param_shapes`` + the mesh rules) to place arrays directly on devices."""
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    if target is None:
        return ckptr.restore(os.path.abspath(os.fspath(path)))
    return ckptr.restore(os.path.abspath(os.fspath(path)), target)


def restore_params_on_mesh(path: str | os.PathLike[str], mesh: Any, preset: str = "serve",
                           **overrides: Any) -> tuple[Any, Any]:
    """``(cfg, params)`` of a converted checkpoint, every array read straight onto ``mesh`` per ``preset``
    (``mesh=None``: the default device, as :func:`restore_params`).

    ``cfg`` comes from the checkpoint's ``k3_config.json`` (``overrides``: config fields such as ``dtype``).
    The target shardings are the model's logical axes under the preset's rules, so on a mesh that spans several
    processes (``jax.distributed``) each process reads only the shards its devices hold; the result is the
    same global arrays a single-process restore onto the same mesh gives.
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from k3_jax.config import config_from_dict
    from k3_jax.model import K3ForCausalLM
    from sharding.rules import param_shardings

    cfg_file = os.path.join(os.fspath(path), "k3_config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{cfg_file} not found: {path} is not a checkpoint written by convert_to_orbax")
    with open(cfg_file) as f:
        cfg = config_from_dict(json.load(f))
    if overrides:
        cfg = cfg.replace(**overrides)
    if mesh is None:
        return cfg, restore_params(path)
    boxed = jax.eval_shape(K3ForCausalLM(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    shardings = param_shardings(boxed, mesh, preset)
    target = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), nn.unbox(boxed),
                          shardings)
    return cfg, restore_params(path, target)
