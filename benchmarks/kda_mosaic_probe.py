"""GPU checks of the Mosaic GPU KDA forward (``pallas_kernels/kda/mosaic_gpu*.py``) that the timing script
(``benchmarks/kda.py --impls mosaic_gpu,triton``) does not make. One JSON line per check on stdout.

``python3 benchmarks/kda_mosaic_probe.py check SHAPES``: for each ``BxTxH`` (comma list) the per-chunk kernel's
six outputs against its plain-JAX reference (the benchmark gate and a 100x milder one; per ``(sequence, head,
chunk)`` errors of ``qg`` when it is off) and the whole forward against the fp32 reference with an initial state,
both V splits; then the TMA addressing pattern of the first split kernels (token tensors indexed ``[b, rows, h]``
on a ``(chunk, head, sequence)`` grid) against the flattened ``[b * T + rows, h]`` one, as plain copies.
Exit status 1 when a check is off.

``python3 benchmarks/kda_mosaic_probe.py defect SHAPES``: the per-chunk kernel's five token outputs against its
reference, twice per shape, on the inputs of the known defect (``pallas_kernels.kda.ops.MOSAIC_GPU_CHUNK_DEFECT``:
seed ``T``, q not normalised). Exit status 1 when a shape is off.

``python3 benchmarks/kda_mosaic_probe.py fla-warm SHAPES``: run fla's ``chunk_kda`` forward once per shape (its
Triton autotuning, cached on disk for the next process), meant to run beside the checks.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

SCALE = 128**-0.5


def shapes(arg: str):
    return [tuple(int(x) for x in s.split("x")) for s in arg.split(",") if s]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(B, T, H, seed, normalize_q: bool = True):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.kda import reference as ref

    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (B, T, H, 128), jnp.float32)
    q = (ref.l2norm(q) if normalize_q else q).astype(jnp.bfloat16)
    k = ref.l2norm(jax.random.normal(ks[1], (B, T, H, 128), jnp.float32)).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, H, 128), jnp.float32).astype(jnp.bfloat16)
    g = ref.kda_gate(jax.random.normal(ks[3], (B, T, H, 128), jnp.float32), jnp.zeros((H,), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32))
    h0 = jax.random.normal(ks[5], (B, H, 128, 128), jnp.float32) * 0.1
    return q, k, v, g, beta, h0


def check_intra(B, T, H):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.kda.mosaic_gpu_intra import intra_chunks, intra_chunks_reference

    q, k, _, g, beta, _ = inputs(B, T, H, seed=7)
    beta_t = jnp.swapaxes(beta, 1, 2)
    fn = jax.jit(lambda *a: intra_chunks(*a, scale=SCALE))
    res, ok = {"check_intra": f"{B}x{T}x{H}"}, True
    for label, gate in (("", g), ("mild_", g * 0.01)):
        got, want = fn(q, k, gate, beta_t), intra_chunks_reference(q, k, gate, beta_t, scale=SCALE)
        for name, a, b in zip(("qg", "kd", "wn", "x", "aqk", "decay"), got, want, strict=True):
            res[f"{label}{name}_rel"] = e = rel(a, b)
            ok &= e < 1e-2
        if res[f"{label}qg_rel"] >= 1e-2:
            a, b = (np.asarray(x, np.float32).reshape(B, T // 64, 64, H, 128) for x in got[0:1] + want[0:1])
            res[f"{label}qg_rel_bch"] = [[[round(rel(a[i, c, :, h], b[i, c, :, h]), 4) for c in range(T // 64)]
                                          for h in range(H)] for i in range(B)]
    return res, ok


def check_forward(B, T, H):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.kda import mosaic_gpu as mg
    from pallas_kernels.kda import reference as ref

    q, k, v, g, beta, h0 = inputs(B, T, H, seed=T)
    f = lambda x: x.astype(jnp.float32)
    ro, rh = ref.chunk_kda(f(q), f(k), f(v), g, f(beta), SCALE, h0, True)
    res, ok = {"check_forward": f"{B}x{T}x{H}"}, True
    for vs in (1, 2):
        o, ht = jax.jit(lambda *a, vs=vs: mg.chunk_kda_fwd(*a, SCALE, h0, v_split=vs))(q, k, v, g, beta)
        res[f"v_split{vs}"] = {"o_rel": rel(o, ro), "ht_rel": rel(ht, rh),
                               "o_finite": bool(np.isfinite(np.asarray(o, np.float32)).all())}
        ok &= res[f"v_split{vs}"]["o_rel"] < 1e-2 and res[f"v_split{vs}"]["ht_rel"] < 1e-2
    return res, ok


def copy_pattern(B, T, H, flat: bool):
    """Copies ``x [B, T, H, 128]`` bf16 and ``y`` f32 through 128-byte swizzled shared-memory tiles, 64 rows per
    CTA, indexed as the first split kernels did (``flat=False``: ``[b, rows, h]``, grid ``(chunk, head,
    sequence)``) or as they do now (``[b * T + rows, h]``, grid ``(chunk, sequence * H + head)``). Returns
    whether both copies are exact."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.kda.mosaic_gpu_common import tiled

    n = T // 64
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, H, 128), jnp.float32)
    xb = x.astype(jnp.bfloat16)

    def kernel(x_ref, y_ref, xo_ref, yo_ref, xs, ys, bar):
        if flat:
            c, bh = lax.axis_index("c"), lax.axis_index("bh")
            idx = (pl.ds(lax.div(bh, H) * T + c * 64, 64), lax.rem(bh, H))
        else:
            c, h, b = lax.axis_index("c"), lax.axis_index("h"), lax.axis_index("b")
            idx = (b, pl.ds(c * 64, 64), h)
        plgpu.copy_gmem_to_smem(x_ref.at[idx], xs, bar)
        plgpu.copy_gmem_to_smem(y_ref.at[idx], ys, bar)
        plgpu.barrier_wait(bar)
        plgpu.copy_smem_to_gmem(xs, xo_ref.at[idx])
        plgpu.copy_smem_to_gmem(ys, yo_ref.at[idx])
        plgpu.wait_smem_to_gmem(0)

    shape = (B * T, H, 128) if flat else (B, T, H, 128)
    out = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct(shape, jnp.bfloat16), jax.ShapeDtypeStruct(shape, jnp.float32)),
        scratch_types=(plgpu.SMEM((64, 128), jnp.bfloat16, transforms=tiled()),
                       plgpu.SMEM((64, 128), jnp.float32, transforms=tiled(jnp.float32)),
                       plgpu.Barrier(num_arrivals=2)),
        grid=(n, B * H) if flat else (n, H, B),
        grid_names=("c", "bh") if flat else ("c", "h", "b"),
    )(xb.reshape(shape), x.reshape(shape))
    return bool(jnp.array_equal(out[0].reshape(xb.shape), xb) and jnp.array_equal(out[1].reshape(x.shape), x))


def main_check(arg: str) -> int:
    import jax

    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    all_ok = True
    for B, T, H in shapes(arg):
        for fn in (check_intra, check_forward):
            t0 = time.perf_counter()
            res, ok = fn(B, T, H)
            res["s"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(res), flush=True)
            all_ok &= ok
    pattern = {f"{layout}_exact": copy_pattern(2, 256, 3, flat=layout == "flat") for layout in ("b_rows_h", "flat")}
    print(json.dumps({"copy_pattern": "2x256x3", **pattern}), flush=True)
    return 0 if all_ok else 1


def main_defect(arg: str) -> int:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.kda.mosaic_gpu_intra import intra_chunks, intra_chunks_reference

    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    reference = jax.jit(lambda *a: intra_chunks_reference(*a, scale=SCALE))
    all_ok = True
    for B, T, H in shapes(arg):
        q, k, _, g, beta, _ = inputs(B, T, H, seed=T, normalize_q=False)
        beta_t = jnp.swapaxes(beta, 1, 2)
        want = reference(q, k, g, beta_t)
        runs = []
        for _ in range(2):
            got = intra_chunks(q, k, g, beta_t, scale=SCALE)
            runs.append({n: (rel(a, b) if np.isfinite(np.asarray(a, np.float32)).all() else "nonfinite")
                         for n, a, b in zip(("qg", "kd", "wn", "x", "aqk"), got[:5], want[:5], strict=True)})
        ok = all(isinstance(e, float) and e < 1e-2 for r in runs for e in r.values())
        print(json.dumps({"defect": f"{B}x{T}x{H}", "ok": ok, "runs": runs}), flush=True)
        all_ok &= ok
    return 0 if all_ok else 1


def main_fla_warm(arg: str) -> int:
    import torch
    from fla.ops.kda import chunk_kda

    for B, T, H in shapes(arg):
        t0 = time.perf_counter()
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, T, H, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
        g = -5 * torch.rand(B, T, H, 128, device="cuda", generator=gen)
        beta = torch.rand(B, T, H, device="cuda", generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            chunk_kda(q, k, v, g, beta, output_final_state=True, safe_gate=True, lower_bound=-5.0)
        torch.cuda.synchronize()
        print(json.dumps({"fla_warm": f"{B}x{T}x{H}", "s": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit({"check": main_check, "defect": main_defect, "fla-warm": main_fla_warm}[sys.argv[1]](sys.argv[2]))
