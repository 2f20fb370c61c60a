"""GPU checks of the Mosaic GPU KDA forward (``pallas_kernels/kda/mosaic_gpu*.py``) that the timing script
(``benchmarks/kda.py --impls mosaic_gpu,triton``) does not make. One JSON line per check on stdout.

``python3 benchmarks/kda_mosaic_probe.py check SHAPES``: for each ``BxTxH`` (comma list) the per-chunk kernel's
six outputs against its plain-JAX reference (the benchmark gate and a 100x milder one; per ``(sequence, head,
chunk)`` errors of ``qg`` when it is off) and the whole forward against the fp32 reference with an initial state,
both V splits; then the TMA addressing pattern of the first split kernels (token tensors indexed ``[b, rows, h]``
on a ``(chunk, head, sequence)`` grid) against the flattened ``[b * T + rows, h]`` one, as plain copies.
Exit status 1 when a check is off.

``python3 benchmarks/kda_mosaic_probe.py defect SHAPES``: the per-chunk kernel's five token outputs against its
reference, twice per shape, on the inputs at which the kernel was wrong while it fed wgmma A operands from registers
(seed ``T``, q not normalised; wrong at 1x64x1-1x64x32, 4x64x8, 2x64x3, 1x128x1, 1x512x1). Exit status 1 when a
shape is off.

``python3 benchmarks/kda_mosaic_probe.py fla-warm SHAPES``: run fla's ``chunk_kda`` forward and backward once per
shape (its Triton compiles, and its autotuning under ``TRITON_CACHE_AUTOTUNING=1``, cached on disk for the next
process), meant to run before a benchmark that times fla.

``python3 benchmarks/kda_mosaic_probe.py stages SHAPES``: on the inputs of ``defect``, per shape: (1) the per-chunk
kernel built with debug taps (``intra_chunks(..., taps=...)``: its intermediates written to extra outputs; every
tap, then only those outside the tile products' loop: :func:`tap_sets`), each tap against a plain-JAX fp32
computation of the same intermediate from the same inputs (:func:`tap_references`), in the kernel's order, naming
the first wrong one; (2) the kernel's five token outputs under each variant of :data:`VARIANTS` (a suspect changed,
the rest as in production; ``--variants a,b`` picks some). One JSON line per taps build and variant. Exit status 1
when anything is off. ``--interpret`` runs it in the Mosaic GPU interpreter (CPU).

``python3 benchmarks/kda_mosaic_probe.py time SHAPES [--variants a,b]``: per shape, the per-chunk kernel's time
under each variant of :data:`VARIANTS` (outputs not checked), then the state pass and the whole forward
(production). One JSON line each. Run it under ``MOSAIC_GPU_DUMP_PTXAS=1`` to see each kernel's registers and
spills.
"""

from __future__ import annotations

import contextlib
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


TAP_TOLERANCE = 1e-2


def tap_references(q, k, g, beta_t, *, scale: float) -> dict:
    """Plain-JAX fp32 (``precision=HIGHEST``) values of every tap of :func:`intra_chunks` (``TAP_WIDTHS``), each
    ``[B, H, Tp / 64, 64, width]``, computed from the same inputs as the kernel defines them (module docstring
    of :mod:`pallas_kernels.kda.mosaic_gpu_intra`): ``G`` = chunk-local cumulative sums of ``g``, ``m_b`` = ``G``
    at the token before tile ``b`` (0 for tile 0)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.kda.mosaic_gpu_common import CHUNK, SUB
    from pallas_kernels.kda.mosaic_gpu_intra import HALVES, TILES

    B, Tp, H, K = q.shape
    n = Tp // CHUNK
    hp = jax.lax.Precision.HIGHEST
    split = lambda x: jnp.moveaxis(x.astype(jnp.float32).reshape(B, n, CHUNK, H, -1), 3, 1)  # [B, H, n, C, D]
    qc, kc, G = split(q), split(k), jnp.cumsum(split(g), axis=3)
    beta = beta_t.astype(jnp.float32).reshape(B, H, n, CHUNK)
    m = [jnp.zeros_like(G[..., :1, :])] + [G[..., SUB * b - 1:SUB * b, :] for b in range(1, TILES)]
    tile_start = jnp.repeat(jnp.concatenate(m, axis=3), SUB, axis=3)  # m_{tile(i)} per row i
    out = {f"p_col{h}": (tile_start - G)[..., cols] for h, cols in enumerate(HALVES)}
    w_col = kc * jnp.exp(tile_start - G)
    out["w_col"] = w_col
    akk, aqk = jnp.zeros(G.shape[:-1] + (CHUNK,)), jnp.zeros(G.shape[:-1] + (CHUNK,))
    for b in range(TILES):
        p_row = G - m[b]
        e = jnp.exp(jnp.minimum(p_row, 0.0))
        for h, cols in enumerate(HALVES):
            out[f"p_row{b}_{h}"], out[f"e{b}_{h}"] = p_row[..., cols], e[..., cols]
        tile = slice(SUB * b, SUB * (b + 1))
        cols_b = w_col[..., tile, :]
        akk = akk.at[..., tile].set(jnp.einsum("...id,...jd->...ij", kc * e, cols_b, precision=hp))
        aqk = aqk.at[..., tile].set(scale * jnp.einsum("...id,...jd->...ij", qc * e, cols_b, precision=hp))
    out["akk"], out["aqk"] = akk, aqk
    lower = jnp.tril(jnp.ones((CHUNK, CHUNK), bool), -1)
    nmat = jnp.where(lower, akk * beta[..., :, None], 0.0)
    out["n"] = nmat
    for h, cols in enumerate(HALVES):
        out[f"p_cum{h}"], out[f"p_last{h}"] = G[..., cols], (G[..., -1:, :] - G)[..., cols]
    out["w_eg"] = kc * jnp.exp(G)
    eye = jnp.eye(CHUNK, dtype=jnp.float32)
    x_inv = jax.scipy.linalg.solve_triangular(eye + nmat, jnp.broadcast_to(eye, nmat.shape), lower=True)
    out["x_inv"] = x_inv
    out["xb"] = x_inv * beta[..., None, :]
    out["wn"] = -jnp.einsum("...ij,...jd->...id", out["xb"], out["w_eg"], precision=hp)
    return out


def tap_masks() -> dict:
    """Which entries of a tap are compared (``[64, width]`` bool): all, except for ``akk`` / ``aqk`` (the tile
    products before masking: entries above the diagonal are undefined or huge) only those the kernel keeps."""
    from pallas_kernels.kda.mosaic_gpu_intra import TAP_WIDTHS

    masks = {name: np.ones((64, w), bool) for name, w in TAP_WIDTHS.items()}
    masks["akk"], masks["aqk"] = np.tri(64, k=-1, dtype=bool), np.tri(64, dtype=bool)
    return masks


def compare_taps(got: dict, want: dict) -> tuple[list[dict], str | None]:
    """Per tap of ``got`` in the kernel's order: ``rel`` (over the compared entries of every chunk), ``finite``, and
    ``bad_chunks`` (``[b, h, c]`` of the chunks whose own error is over :data:`TAP_TOLERANCE`, at most 8); and the
    name of the first wrong tap (None if all are right)."""
    from pallas_kernels.kda.mosaic_gpu_intra import TAP_WIDTHS

    masks, rows, first = tap_masks(), [], None
    for name in (n for n in TAP_WIDTHS if n in got):
        a, b = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
        mask = np.broadcast_to(masks[name], a.shape)
        a, b = np.where(mask, a, 0.0), np.where(mask, b, 0.0)
        finite = bool(np.isfinite(a).all())
        err = rel(np.nan_to_num(a, nan=1e30, posinf=1e30, neginf=-1e30), b)
        with np.errstate(over="ignore", invalid="ignore"):  # non-finite taps count as bad chunks
            per_chunk = (np.linalg.norm(np.nan_to_num(a - b, nan=1e30), axis=(-2, -1))
                         / np.maximum(np.linalg.norm(b, axis=(-2, -1)), 1e-30))
        bad = [list(map(int, i)) for i in np.argwhere(~(per_chunk <= TAP_TOLERANCE))[:8]]
        rows.append({"tap": name, "rel": err, "finite": finite, "bad_chunks": bad})
        if first is None and (not finite or not err <= TAP_TOLERANCE):
            first = name
    return rows, first


@contextlib.contextmanager
def patched(module, **attrs):
    """Set ``module``'s attributes for the duration (the kernel is traced inside)."""
    old = {name: getattr(module, name) for name in attrs}
    for name, value in attrs.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


def _mma_register_a(acc, a_ref, b_ref) -> None:
    """``acc += a @ b`` with ``a`` loaded from shared memory into registers first: wgmma reading its A operand from
    registers, as the kernel did until session 25 (wrong at some shapes on the H200)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.wgmma(acc, plgpu.layout_cast(a_ref[...], plgpu.Layout.WGMMA), b_ref)


VARIANTS = {
    "production": {},
    "register_a": {"_mma": _mma_register_a},
}
"""The per-chunk kernel with a suspect changed in :mod:`pallas_kernels.kda.mosaic_gpu_intra` while it is traced
(name -> module attributes): ``register_a`` puts every A operand back in registers (the known defect)."""


def main_time(arg: str, variants: tuple[str, ...]) -> int:
    import jax
    import jax.numpy as jnp

    from benchmarks.kda import time_jax
    from pallas_kernels.kda import mosaic_gpu as mg
    from pallas_kernels.kda import mosaic_gpu_intra as mgi
    from pallas_kernels.kda.mosaic_gpu_state import state_pass

    median_ms = lambda fn, *a: time_jax(fn, *a, iters=20, repeats=5)

    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    for B, T, H in shapes(arg):
        shape = f"{B}x{T}x{H}"
        q, k, v, g, beta, _ = inputs(B, T, H, seed=T)
        args = (q, k, g, jnp.swapaxes(beta, 1, 2))
        for name in variants:
            with patched(mgi, **VARIANTS[name]):
                t0 = time.perf_counter()
                try:
                    fn = jax.jit(lambda *a: mgi.intra_chunks(*a, scale=SCALE)).lower(*args).compile()
                    res = {"compile_s": round(time.perf_counter() - t0, 1), "intra_ms": median_ms(fn, *args)}
                except Exception as e:  # noqa: BLE001 - a probe: the failure is reported, the next one runs
                    res = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            print(json.dumps({"time": shape, "variant": name, **res}), flush=True)
        parts = jax.jit(lambda *a: mgi.intra_chunks(*a, scale=SCALE))(*args)
        h0_t = jnp.zeros((B, H, 128, 128), jnp.float32)
        v_split = mg.default_v_split(B, H)
        state = jax.jit(lambda p, v, h, vs=v_split: state_pass(*p[:3], v, *p[3:], h, v_split=vs))
        fwd = jax.jit(lambda *a: mg.chunk_kda_fwd(*a, SCALE))
        print(json.dumps({"time": shape, "state_pass_ms": median_ms(state, parts, v, h0_t), "v_split": v_split,
                          "forward_ms": median_ms(fwd, q, k, v, g, beta)}), flush=True)
    return 0


def tap_sets() -> dict:
    """The taps builds a shape is probed with: ``all``, and ``outside_tile_loop`` (no tap inside the scope of the
    tile products' accumulators, whose instruction stream then stays as in production)."""
    from pallas_kernels.kda.mosaic_gpu_intra import TAP_WIDTHS

    inside = tuple(n for n in TAP_WIDTHS if n.startswith(("p_row", "e")) and n[-2] == "_")
    return {"all": tuple(TAP_WIDTHS), "outside_tile_loop": tuple(n for n in TAP_WIDTHS if n not in inside)}


def _taps_build(args, want, tap_want, names, ip):
    """The taps build with ``names`` on ``args``: its taps against ``tap_want`` and outputs against ``want``."""
    import jax

    from pallas_kernels.kda import mosaic_gpu_intra as mgi

    taps = jax.jit(lambda *a: mgi.intra_chunks(*a, scale=SCALE, interpret=ip, taps=names))(*args)
    rows, first = compare_taps(taps[6], tap_want)
    return {"first_wrong": first, "outputs": _out_errors(taps, want), "taps": rows}, first is None


def _variant(args, want, name, ip):
    """The per-chunk kernel under variant ``name`` on ``args``, its outputs against ``want``."""
    import jax

    from pallas_kernels.kda import mosaic_gpu_intra as mgi

    with patched(mgi, **VARIANTS[name]):
        got = jax.block_until_ready(jax.jit(lambda *a: mgi.intra_chunks(*a, scale=SCALE, interpret=ip))(*args))
    outs = _out_errors(got, want)
    ok = all(isinstance(e, float) and e < TAP_TOLERANCE for e in outs.values())
    return {"ok": ok, **outs}, ok


def main_stages(arg: str, interpret: bool = False, variants: tuple[str, ...] = tuple(VARIANTS)) -> int:
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels.kda import mosaic_gpu_intra as mgi
    from pallas_kernels.kda.mosaic_gpu_common import interpret_params

    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "interpret": interpret}),
          flush=True)
    ip = interpret_params(interpret)
    reference = jax.jit(lambda *a: mgi.intra_chunks_reference(*a, scale=SCALE))
    all_ok = True
    for B, T, H in shapes(arg):
        shape = f"{B}x{T}x{H}"
        q, k, _, g, beta, _ = inputs(B, T, H, seed=T, normalize_q=False)
        args = (q, k, g, jnp.swapaxes(beta, 1, 2))
        want = reference(*args)
        tap_want = tap_references(*args, scale=SCALE)
        jobs = [({"stages": shape, "taps_set": n}, functools.partial(_taps_build, args, want, tap_want, names, ip))
                for n, names in tap_sets().items()]
        jobs += [({"variant": n, "shape": shape}, functools.partial(_variant, args, want, n, ip)) for n in variants]
        for label, job in jobs:
            t0 = time.perf_counter()
            try:
                res, ok = job()
            except Exception as e:  # noqa: BLE001 - a probe: the failure is reported, the next job runs
                res, ok = {"error": f"{type(e).__name__}: {str(e)[:400]}"}, False
            print(json.dumps({**label, **res, "s": round(time.perf_counter() - t0, 1)}), flush=True)
            all_ok &= ok
    return 0 if all_ok else 1


def _out_errors(got, want) -> dict:
    return {n: _out_error(a, b) for n, a, b in zip(("qg", "kd", "wn", "x", "aqk"), got[:5], want[:5], strict=True)}


def _out_error(a, b):
    return rel(a, b) if np.isfinite(np.asarray(a, np.float32)).all() else "nonfinite"


def main_fla_warm(arg: str) -> int:
    import torch
    from fla.ops.kda import chunk_kda

    for B, T, H in shapes(arg):
        t0 = time.perf_counter()
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, T, H, 128, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        g = (-5 * torch.rand(B, T, H, 128, device="cuda", generator=gen)).requires_grad_()
        beta = torch.rand(B, T, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
        o, _ = chunk_kda(q, k, v, g, beta, output_final_state=True, safe_gate=True, lower_bound=-5.0)
        o.float().sum().backward()
        torch.cuda.synchronize()
        print(json.dumps({"fla_warm": f"{B}x{T}x{H}", "s": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


def _variants_option(opts: list[str]) -> tuple[str, ...]:
    """``--variants a,b`` from ``opts`` (every variant when absent); exits naming any unknown one."""
    chosen = opts[opts.index("--variants") + 1].split(",") if "--variants" in opts else list(VARIANTS)
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; expected names from {list(VARIANTS)}")
    return tuple(chosen)


if __name__ == "__main__":
    if sys.argv[1] == "time":
        sys.exit(main_time(sys.argv[2], _variants_option(sys.argv[3:])))
    if sys.argv[1] == "stages":
        opts = sys.argv[3:]
        sys.exit(main_stages(sys.argv[2], interpret="--interpret" in opts, variants=_variants_option(opts)))
    sys.exit({"check": main_check, "defect": main_defect, "fla-warm": main_fla_warm}[sys.argv[1]](sys.argv[2]))
