"""Compile for an NVIDIA H200 on a host without a GPU: XLA:GPU's optimised program, its kernel launches, and
``ptxas``'s register / spill / shared-memory report of every Mosaic GPU kernel in it.

    python benchmarks/gpu_aot.py [--kernels kda_fwd,kda_fwd_bwd,kda_decode,moe_glu,moe_mxfp4,paged_mla]

One JSON line per Mosaic GPU kernel (``ptxas``'s report) and one summary line per case. Needs the CUDA PJRT plugin
of the H200's JAX (``pip install "jax[cuda13]==0.11.2"``, ~4 GB; no GPU and no driver are used): JAX's deviceless
GPU topology (``jax.experimental.topologies.get_topology_desc(platform="cuda", topology=..., target_config=...)``)
takes :data:`H200_TARGET_CONFIG`, XLA:GPU compiles against it, and Mosaic GPU runs ``ptxas`` for ``sm_90a`` at
compile time, so a kernel that fails to compile, spills or exceeds shared memory shows here, not first on the
H200. Timings still need the H200: this says what runs, not how fast.

Library use (``benchmarks/decode_aot.py --targets h200``): :func:`h200_device`, :func:`compile_for_h200`,
:func:`kernel_launches`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

H200_TARGET_CONFIG = """
gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""
"""XLA:GPU's target description of an H200 SXM (sm_90, 132 SMs, 227 KiB of opt-in shared memory per block,
50 MiB L2, 4.8 TB/s HBM3e, 141 GB): what XLA's cost model and ``ptxas`` compile for."""

H200_COMPUTE_CAPABILITY = 9.0


def h200_device() -> Any:
    """A compile-only H200 device (no GPU needed); raises naming the missing plugin when JAX has no CUDA one."""
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=H200_TARGET_CONFIG)
    except (NotImplementedError, RuntimeError) as e:
        raise RuntimeError("compiling for the H200 needs JAX's CUDA PJRT plugin (pip install "
                           f"'jax[cuda13]==<this JAX's version>'): {e}") from e
    return topo.devices[0]


def on_h200(fn: Callable) -> Callable:
    """``fn`` traced for the H200: ``platform="gpu"`` and compute capability 9.0 for every kernel registry inside
    (:func:`pallas_kernels.registry.platform_scope`, entered inside the traced function)."""
    from pallas_kernels.registry import platform_scope

    def traced(*args: Any) -> Any:
        with platform_scope("gpu", compute_capability=H200_COMPUTE_CAPABILITY):
            return fn(*args)

    return traced


def compile_for_h200(fn: Callable, *args: Any, donate_argnums: tuple[int, ...] = (),
                     compiler_options: dict | None = None) -> Any:
    """``jax.jit(on_h200(fn)).lower(*args).compile()`` for :func:`h200_device`; ``args``: ``ShapeDtypeStruct``s
    (their shardings are replaced by the H200's). The H200 is the default device meanwhile (Pallas Triton reads
    the target's architecture from it)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    dev = h200_device()
    sharding = SingleDeviceSharding(dev)
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    with jax.default_device(dev):
        return jax.jit(on_h200(fn), donate_argnums=donate_argnums, out_shardings=sharding,
                       compiler_options=compiler_options).lower(*placed).compile()


_ASYNC_DONE = ("-done",)
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency"}


def launched_instructions(hlo_text: str) -> Iterator[tuple[Any, int]]:
    """``(instruction, times)`` for each instruction of an optimised XLA:GPU program that launches kernels in one
    run: a ``while`` body's count is its known trip count (nested loops multiply), ``conditional`` / ``call``
    bodies count once; free ops (parameters, tuples, bitcasts, ...) and the ``-done`` halves of async pairs are
    skipped (their ``-start`` is the launch)."""
    from benchmarks.hlo_bytes import parse_module

    comps, entry = parse_module(hlo_text)

    def walk(comp: str, times: int) -> Iterator[tuple[Any, int]]:
        for ins in comps.get(comp, []):
            op = ins.opcode
            if op in _FREE or op.endswith(_ASYNC_DONE):
                continue
            if op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.text)
                body = re.search(r"body=%?([\w.\-]+)", ins.text).group(1)
                yield from walk(body, times * (int(trips.group(1)) if trips else 1))
                continue
            if op in ("conditional", "call"):
                for group in re.findall(r"(?:branch_computations=\{|to_apply=)([^}]*?)(?:\}|,\s*\w+=|$)", ins.text):
                    for name in re.findall(r"%?([\w.\-]+)", group):
                        if name in comps:
                            yield from walk(name, times)
                continue
            yield ins, times

    yield from walk(entry, 1)


def kernel_launches(hlo_text: str) -> Counter:
    """Kernel launches of one run of an optimised XLA:GPU program (:func:`launched_instructions`), by kind:
    ``gemm`` (cuBLAS, plain or fused with a slice), ``pallas:<name>`` (Triton / Mosaic GPU custom calls),
    ``fusion:<kind>`` (XLA's own kernels, by the fused computation's name less its number), ``copy``, other opcodes
    as themselves."""
    out: Counter = Counter()
    for ins, times in launched_instructions(hlo_text):
        out[_launch_kind(ins)] += times
    return out


def launches_by_scope(hlo_text: str, depth: int = 2) -> Counter:
    """Kernel launches of one run by source scope: the first ``depth`` parts of each instruction's ``op_name``
    after its last ``layer_<i>/`` (so the layers of a scanned segment add up), else after the jit and module
    prefixes; ``?`` where XLA kept no ``op_name``."""
    out: Counter = Counter()
    for ins, times in launched_instructions(hlo_text):
        name = re.search(r'op_name="([^"]*)"', ins.text)
        if name is None:
            out["?"] += times
            continue
        tail = re.sub(r"^.*(?:layer_\d+/|while/body/eval_jaxpr/|^jit\([^)]*\)/)", "", name.group(1))
        out["/".join(tail.split("/")[:depth])] += times
    return out


def _launch_kind(ins: Any) -> str:
    target = re.search(r'custom_call_target="([^"]+)"', ins.text)
    if ins.opcode == "custom-call" and target:
        t = target.group(1)
        if "cublas" in t:
            return "gemm"
        if t in ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2"):
            name = re.search(r'op_name="[^"]*?([\w.<>]+)/(?:pallas_call|mpmd_map)"', ins.text)  # the call's scope
            return f"pallas:{name.group(1) if name else t}"
        return f"custom-call:{t}"
    if ins.opcode in ("fusion", "fusion-start"):
        if "__cublas" in ins.text or '"kind":"__custom_fusion"' in ins.text or "dynamic-slice-fusion" in ins.text:
            return "gemm"
        called = re.search(r"calls=%?([\w.\-]+)", ins.text)
        return "fusion:" + re.sub(r"(\.(\d+|clone))+$", "", called.group(1) if called else "?").removeprefix("fused_")
    return ins.opcode


@contextlib.contextmanager
def captured_output() -> Iterator[list[str]]:
    """Lines the process (C++ included: ``ptxas``'s report goes to standard output) writes to file descriptors 1
    and 2 inside the block."""
    lines: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())


def ptxas_reports(lines: list[str]) -> list[dict]:
    """``[{"kernel", "arch", "warnings", "registers", "spill_stores", "spill_loads", "stack", "barriers",
    "smem_static"}]`` from ``ptxas -v`` output (``MOSAIC_GPU_DUMP_PTXAS=1``), one per compiled entry function;
    ``warnings``: ``ptxas``'s performance advisories for it (e.g. C7511, wgmma serialised for lack of registers)."""
    out: list[dict] = []
    pending: list[str] = []
    for line in lines:
        if m := re.search(r"Compiling entry function '([^']+)' for '(\w+)'", line):
            out.append({"kernel": m.group(1), "arch": m.group(2), "warnings": pending})
            pending = []
        elif m := re.search(r"ptxas info\s*: \((C\d+)\) ([^']*)", line):  # advisories come before the entry's name
            pending.append(f"{m.group(1)} {m.group(2).strip()}")
        elif out and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                                      line)):
            out[-1].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif out and (m := re.search(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?", line)):
            out[-1].update(registers=int(m.group(1)), barriers=int(m.group(2) or 0), smem_static=int(m.group(3) or 0))
    return out


def _cases() -> dict[str, Callable[[], tuple[Callable, tuple]]]:
    """Name -> ``() -> (fn, abstract args)`` of each Mosaic GPU kernel family at K3's shapes."""
    import jax
    import jax.numpy as jnp

    s = jax.ShapeDtypeStruct
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32

    def kda_fwd_bwd():
        from pallas_kernels.kda import ops

        b, t, h, k = 1, 8192, 96, 128

        def loss(q, kk, v, g, beta):
            o, _ = ops.chunk_kda(q, kk, v, g, beta, scale=k ** -0.5, gate_bound=-5.0,
                                 implementation="mosaic_gpu", backward="mosaic_gpu")
            return jnp.sum(o.astype(f32))

        vec = s((b, t, h, k), bf)
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4)), (vec, vec, vec, s((b, t, h, k), f32), s((b, t, h), f32))

    def kda_fwd():
        from pallas_kernels.kda import ops

        b, t, h, k = 1, 8192, 96, 128
        vec = s((b, t, h, k), bf)
        return (lambda q, kk, v, g, beta: ops.chunk_kda(q, kk, v, g, beta, scale=k ** -0.5, gate_bound=-5.0,
                                                        implementation="mosaic_gpu")[0]), (
            vec, vec, vec, s((b, t, h, k), f32), s((b, t, h), f32))

    def paged_mla():
        from pallas_kernels import paged_latent_attention as pla

        b, pages_per_row, h = 16, 2048, 96  # rows up to 32,768 tokens in 16-token pages
        return (lambda ql, qr, pages, table, pos: pla.paged_attention_mgpu(ql, qr, pages, None, table, pos, 0.07)), (
            s((b, 1, h, 512), bf), s((b, 1, h, 64), bf), s((b * pages_per_row + 1, 16, 576), bf),
            s((b, pages_per_row), i32), s((b,), i32))

    def kda_decode():
        from pallas_kernels.kda import mosaic_gpu_decode

        b, h = 64, 96
        vec = s((b, h, 128), bf)
        return (lambda q, k, v, g, beta, pool, slots: mosaic_gpu_decode.decode_step(q, k, v, g, beta, 0.088, pool,
                                                                                     slots)), (
            vec, vec, vec, s((b, h, 128), f32), s((b, h), f32), s((b + 3, h, 128, 128), f32), s((b,), i32))

    def moe_glu():
        from pallas_kernels.moe import ops

        m, e, d, n = 65536, 64, 3584, 3072
        w = s((e, d, n), bf)
        return (lambda x, w1, w3, w2, gs: ops.expert_ffn(x, gs, w1, w3, w2, implementation="mosaic_gpu")), (
            s((m, d), bf), w, w, s((e, n, d), bf), s((e,), i32))

    def moe_mxfp4():
        from pallas_kernels.moe import ops

        tokens, top_k, e, d, n = 64, 16, 896, 3584, 3072

        def mx(rows: int, cols: int) -> dict:
            u8 = jnp.uint8
            return {"weight_packed": s((e, rows, cols // 2), u8), "weight_scale": s((e, rows, cols // 32), u8)}

        return (lambda z, ids, wts, w1, w3, w2: ops.moe_dispatch_combine(
            z, ids, wts, {"w1": w1, "w3": w3, "w2": w2}, implementation="mosaic_gpu")), (
            s((tokens, d), bf), s((tokens, top_k), i32), s((tokens, top_k), f32), mx(n, d), mx(n, d), mx(d, n))

    return {"kda_fwd": kda_fwd, "kda_fwd_bwd": kda_fwd_bwd, "kda_decode": kda_decode, "moe_glu": moe_glu,
            "moe_mxfp4": moe_mxfp4, "paged_mla": paged_mla}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cases = _cases()
    ap.add_argument("--kernels", default=",".join(cases), help=f"comma list of {sorted(cases)}")
    args = ap.parse_args(argv)
    for name in args.kernels.split(","):
        fn, abstract = cases[name]()
        try:
            with captured_output() as lines:
                compiled = compile_for_h200(fn, *abstract)
            reports = ptxas_reports(lines)
            for r in reports:
                print(json.dumps({"bench": "gpu_aot", "case": name, **r}), flush=True)
            launches = kernel_launches(compiled.as_text())
            print(json.dumps({"bench": "gpu_aot", "case": name, "compiled": True, "mosaic_gpu_kernels": len(reports),
                              "max_registers": max((r.get("registers", 0) for r in reports), default=None),
                              "spill_bytes": sum(r.get("spill_stores", 0) + r.get("spill_loads", 0) for r in reports),
                              "launches": sum(launches.values()),
                              "pallas": {k: v for k, v in launches.items() if k.startswith("pallas:")}}), flush=True)
        except Exception as e:  # noqa: BLE001 - report the case and go on with the next
            print(json.dumps({"bench": "gpu_aot", "case": name, "compiled": False,
                              "error": f"{type(e).__name__}: {str(e)[:800]}"}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")
    sys.path.insert(0, str(REPO))
    main()
