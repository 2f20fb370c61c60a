"""KDA chunked forward on Pallas Mosaic GPU: the per-platform selection (CPU), the two kernels' numerics in the
Mosaic GPU interpreter against the references, their lowering for sm_90 from this CPU host, and forward + gradients
on a GPU (``-m gpu``)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import registry
from pallas_kernels.kda import _layout, gpu_bwd, mosaic_gpu, ops
from pallas_kernels.kda import reference as ref
from pallas_kernels.kda.mosaic_gpu_common import interpret_params
from pallas_kernels.kda.mosaic_gpu_intra import intra_chunks, intra_chunks_reference
from pallas_kernels.registry import KernelUnavailable
from tests._gpu import skip_unless_hopper
from tests._mosaic_gpu_lowering import JAX_0112_PYTHON, lower_for_sm90, run_under_jax_0112

K3 = (1, 8192, 96, 128, 128)  # B, T, H, K, V


def _call(platform="gpu", cc=9.0, dtype="bfloat16", shape=K3, chunk=64, gate_bound=-5.0, interpret=False,
          packed=False):
    return ops.KdaCall(platform, dtype, shape, chunk, gate_bound, interpret, cc, packed)


@pytest.mark.parametrize("call, want, why", [
    (_call(), "mosaic_gpu", None),  # sm_90+
    (_call(shape=(8, 4096, 32, 128, 128)), "mosaic_gpu", None),
    (_call(cc=8.0), "triton", "compute capability >= 9.0"),  # A100 / L4 / T4 class
    (_call(packed=True), "mosaic_gpu", None),
    (_call(dtype="float32"), "triton", "bfloat16"),
    (_call(platform="cpu", cc=None), "xla", "target is cpu"),
])
def test_auto_order_with_triton_shipped(monkeypatch, caplog, call, want, why):
    """While JAX ships Triton: mosaic_gpu on sm_90+, else triton on a GPU (mosaic_gpu passed over with why it
    cannot run the call), else the XLA reference; the choice is logged with each passed-over backend's reason."""
    monkeypatch.setattr(registry, "TRITON_SHIPPED", True)
    monkeypatch.setattr(registry, "_SELECTIONS", {})
    with caplog.at_level("INFO", logger=registry.logger.name):
        sel = ops.CHUNK.select("auto", call)
    assert sel.backend == want
    assert f"kernel choice kda.chunk: {want} (auto" in caplog.text, caplog.text
    if why is not None:
        assert why in dict(sel.passed_over)["mosaic_gpu"]


@pytest.mark.parametrize("call, want, why", [
    (_call(), "mosaic_gpu", None),
    (_call(shape=(2, 100, 3, 128, 128)), "mosaic_gpu", None),
    (_call(cc=8.0), "xla", "compute capability >= 9.0"),  # A100 / L4 / T4 class
    (_call(cc=None), "xla", "unknown"),
    (_call(packed=True), "mosaic_gpu", None),
    (_call(dtype="float32"), "xla", "bfloat16"),
    (_call(shape=(1, 64, 2, 64, 64)), "xla", "K = V = 128"),
    (_call(chunk=32), "xla", "chunk_size 64"),
    (_call(gate_bound=None), "xla", "g >= -5"),
    (_call(platform="cpu", cc=None), "xla", "target is cpu"),
])
def test_auto_order_once_jax_drops_triton(monkeypatch, call, want, why):
    """Without the Pallas Triton backend: mosaic_gpu on sm_90+, else the XLA reference, each passed-over backend
    with its reason."""
    monkeypatch.setattr(registry, "TRITON_SHIPPED", False)
    sel = ops.CHUNK.select("auto", call, record=False)
    assert sel.backend == want
    passed = dict(sel.passed_over)
    if why is None:
        return
    if call.platform == "gpu":
        assert "no longer ships" in passed["triton"]
    assert why in passed["mosaic_gpu"]


def check_explicit_mosaic_gpu(registry, make_call) -> None:
    """``registry``'s explicit ``mosaic_gpu`` runs on sm_90 and in the CPU interpreter, and raises with the reason on
    an older GPU and on a CPU target without the interpreter (``make_call(platform=, cc=, interpret=)``)."""
    assert registry.select("mosaic_gpu", make_call(), record=False).backend == "mosaic_gpu"
    assert registry.select("mosaic_gpu", make_call(platform="cpu", cc=None, interpret=True),
                           record=False).backend == "mosaic_gpu"
    with pytest.raises(KernelUnavailable, match="compute capability >= 9.0"):
        registry.select("mosaic_gpu", make_call(cc=8.6), record=False)
    with pytest.raises(KernelUnavailable, match="Mosaic GPU interpreter"):
        registry.select("mosaic_gpu", make_call(platform="cpu", cc=None), record=False)


def test_explicit_mosaic_gpu_runs_where_it_fits_and_raises_with_the_reason_elsewhere():
    check_explicit_mosaic_gpu(ops.CHUNK, _call)


def test_backward_choice(monkeypatch):
    monkeypatch.setattr(registry, "TRITON_SHIPPED", True)
    assert ops._backward_for("mosaic_gpu", "auto") == "kernel"
    monkeypatch.setattr(registry, "TRITON_SHIPPED", False)
    assert ops._backward_for("mosaic_gpu", "auto") == "mosaic_gpu"  # every step on Mosaic GPU, no Triton kernel
    with pytest.raises(ValueError, match="no longer ships"):
        ops._backward_for("mosaic_gpu", "kernel")
    assert ops._backward_for("triton", "auto") == "kernel"
    assert ops._backward_for("mosaic_gpu", "mosaic_gpu") == "mosaic_gpu"
    with pytest.raises(ValueError, match="needs implementation 'mosaic_gpu'"):
        ops._backward_for("triton", "mosaic_gpu")


def test_mosaic_gpu_backward_runs_no_triton_kernel():
    """``chunk_kda(implementation="mosaic_gpu", backward="mosaic_gpu")``: the gradient's program (traced, not run)
    holds the Mosaic GPU forward with its per-chunk results and every Mosaic GPU backward step, and no Triton
    kernel; ``backward="kernel"`` holds the Mosaic GPU kernels of ``KERNEL_BACKWARD_MOSAIC_GPU_STEPS`` and the
    Triton ones of the other steps."""
    from pallas_kernels.kda import gpu_bwd  # noqa: PLC0415

    q, k, v, g, beta = _inputs(1, 64, 1)[:5]

    def program(backward):
        loss = lambda *a: jnp.sum(ops.chunk_kda(*a, implementation="mosaic_gpu", interpret=True,
                                                backward=backward)[0].astype(jnp.float32))
        return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta))

    mosaic = program("mosaic_gpu")
    assert all(name in mosaic for name in ("kda_bwd_h_mosaic_gpu", "kda_bwd_dqkw_mosaic_gpu",
                                           "kda_bwd_wy_mosaic_gpu", "kda_bwd_da_mosaic_gpu"))
    assert not [name for name in gpu_bwd.KERNEL_NAMES if name in mosaic]
    kernel = program("kernel")
    assert all(name in kernel for name in ("kda_bwd_h_mosaic_gpu", "kda_bwd_dqkw_mosaic_gpu", "kda_bwd_wy_mosaic_gpu",
                                           "kda_bwd_da_gpu"))
    assert not [name for name in ("kda_bwd_dqkw_gpu", "kda_bwd_h_gpu", "kda_bwd_wy_dx_gpu", "kda_bwd_da_mosaic_gpu")
                if name in kernel]


def _inputs(B, T, H, seed=0, dtype=jnp.bfloat16, aligned=False):
    """Random inputs at K = V = 128; ``aligned``: keys near one direction and almost no decay (``g = -1e-3``), as
    in a trained model's repetitive text: the powers of ``diag(beta) A_kk`` reach ~1e17 while its inverse stays
    bounded."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = ref.l2norm(jax.random.normal(ks[0], (B, T, H, 128), jnp.float32)).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, H, 128), jnp.float32)
    k = ref.l2norm(k[:, :1] + 0.3 * k if aligned else k).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, H, 128), jnp.float32).astype(dtype)
    g = ref.kda_gate(jax.random.normal(ks[3], (B, T, H, 128), jnp.float32), jnp.zeros((H,), jnp.float32))
    if aligned:
        g = jnp.full_like(g, -1e-3)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32))
    h0 = jax.random.normal(ks[5], (B, H, 128, 128), jnp.float32) * 0.1
    return q, k, v, g, beta, h0


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _reference(q, k, v, g, beta, h0, segment_ids=None):
    f = lambda x: x.astype(jnp.float32)
    return ref.chunk_kda(f(q), f(k), f(v), g, f(beta), None, h0, True, segment_ids)


def _documents(B, T, starts):
    """``segment_ids [B, T]``: documents starting at ``starts`` (the same in every row)."""
    return jnp.broadcast_to(jnp.cumsum(jnp.zeros((T,), jnp.int32).at[jnp.array(starts)].set(1)), (B, T))


@pytest.mark.parametrize("via_ops", [True, False])
def test_interpreter_forward_and_final_state_match_reference(via_ops):
    """Three chunks (T padded from 130 to 192) with an initial state, both kernels on the Mosaic GPU interpreter:
    through ``ops.chunk_kda`` at one sequence and head with packed sequences (documents starting at tokens 20, 50
    (both in chunk 0), 64 (a chunk boundary) and 120; the default split for one head: two CTAs of one state
    warpgroup), and directly with ``v_split=1`` (one CTA, two state warpgroups) at two sequences of three heads
    (the flattened sequence / head addressing of every copy). Every slot, barrier phase and the padding path run;
    errors are at the bf16-operand level."""
    B, H = (1, 1) if via_ops else (2, 3)
    q, k, v, g, beta, h0 = _inputs(B, 130, H)
    seg = _documents(B, 130, [20, 50, 64, 120]) if via_ops else None
    if via_ops:
        assert mosaic_gpu.default_v_split(1, 1, sms=mosaic_gpu.DEFAULT_SMS) == 2
        o, ht = ops.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, segment_ids=seg,
                              implementation="mosaic_gpu", interpret=True, platform="cpu")
    else:
        o, ht = mosaic_gpu.chunk_kda_fwd(q, k, v, g, beta, 128**-0.5, h0, interpret=True, v_split=1)
    ro, rh = _reference(q, k, v, g, beta, h0, seg)
    assert o.dtype == jnp.bfloat16 and o.shape == q.shape and ht.shape == h0.shape
    assert _rel(o, ro) < 1e-2 and _rel(ht, rh) < 1e-2


@pytest.mark.parametrize("packed", [False, True])
def test_interpreter_per_chunk_kernel_matches_its_reference(packed):
    """The per-chunk kernel's six outputs and its two residuals for the backward (``A_kk``, ``X``) against the
    plain-JAX reference, with a mild gate (the chunk decay is not 0) so that every output, ``decay`` included, is
    checked. Packed: documents start at tokens 20 and 50 of chunk 0 (its decay 0, its state operands masked) and
    none in chunk 1 (its decay kept); the masked outputs differ from the unpacked kernel's."""
    q, k, _, g, beta, _ = _inputs(1, 128, 2, seed=3)
    beta_t = jnp.swapaxes(beta, 1, 2)
    g = g * 0.01
    seg = _layout.chunk_document_starts(_documents(1, 128, [20, 50]), 1, 128, 64).reshape(1, 128) if packed else None
    got = intra_chunks(q, k, g, beta_t, scale=128**-0.5, seg=seg, interpret=interpret_params(True), residuals=True)
    want = intra_chunks_reference(q, k, g, beta_t, scale=128**-0.5, seg=seg, residuals=True)
    for name, a, b in zip(("qg", "kd", "wn", "x", "aqk", "decay"), got[:6], want[:6], strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert _rel(a, b) < 1e-2, name
    assert sorted(got[6]) == sorted(want[6]) == ["akk", "x_inv"]
    for name, b in want[6].items():
        a = got[6][name]
        assert a.shape == b.shape == (4, 64, 64) and a.dtype == b.dtype == jnp.float32, name
        assert _rel(a, b) < 1e-2, name
    if packed:
        plain = intra_chunks_reference(q, k, g, beta_t, scale=128**-0.5)
        assert float(jnp.abs(got[5][:, :, 0]).max()) == 0.0 and float(jnp.abs(got[5][:, :, 1]).min()) > 0.0
        for name, a, b in zip(("qg", "kd", "wn", "x", "aqk"), got[:5], plain[:5], strict=True):
            assert _rel(a[:, :64], b[:, :64]) > 0.1 and _rel(a[:, 64:], b[:, 64:]) < 1e-2, name


@pytest.mark.parametrize("packed", [False, True])
def test_interpreter_gradients_take_the_forward_chunks(packed):
    """``mosaic_gpu`` with the Triton backward, both interpreted (T = 130 padded to 192, an initial state; two
    sequences; packed: one sequence, documents starting at tokens 20, 50, 64 and 120): the backward takes the
    forward's per-chunk results (its recomputing kernels are not in the program) and its gradients match the fp32
    reference's VJP and the Triton backward that recomputes them."""
    q, k, v, g, beta, h0 = _inputs(1 if packed else 2, 130, 1, seed=4)
    seg = _documents(1, 130, [20, 50, 64, 120]) if packed else None
    do = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.float32)

    def loss(impl, *a):
        o, ht = ops.chunk_kda(*a, initial_state=h0, output_final_state=True, segment_ids=seg, implementation=impl,
                              interpret=True, platform="cpu")
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(ht)

    grads = jax.grad(lambda *a: loss("mosaic_gpu", *a), argnums=(0, 1, 2, 3, 4))
    program = str(jax.make_jaxpr(grads)(q, k, v, g, beta))
    assert "kda_bwd_da_gpu" in program
    assert not any(name in program for name in gpu_bwd.RECOMPUTE_KERNEL_NAMES)
    got = grads(q, k, v, g, beta)
    f = lambda x: x.astype(jnp.float32)
    want = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2, 3, 4))(f(q), f(k), f(v), g, f(beta))
    recomputed = gpu_bwd.chunk_kda_bwd(q, k, v, g, beta, 128**-0.5, h0, seg, do.astype(jnp.bfloat16),
                                       jnp.ones_like(h0), interpret=True)
    for name, a, b, c in zip("q k v g beta".split(), got, want, recomputed[:5], strict=True):
        assert a.shape == c.shape and a.dtype == c.dtype, name
        assert _rel(a, b) < 2e-2 and _rel(a, c) < 1e-2, (name, _rel(a, b), _rel(a, c))


def test_backward_names_a_residual_of_the_wrong_layout():
    """``gpu_bwd.chunk_kda_bwd(residuals=...)`` raises naming the field, its expected and its actual dtype/shape."""
    q, k, v, g, beta, _ = _inputs(1, 64, 1)
    shape = lambda *d: jax.ShapeDtypeStruct(d, jnp.bfloat16)
    f32 = lambda *d: jax.ShapeDtypeStruct(d, jnp.float32)
    good = _layout.ChunkResiduals(shape(1, 64, 1, 128), shape(1, 64, 1, 128), shape(1, 64, 1, 128),
                                  shape(1, 64, 1, 64), shape(1, 64, 1, 64), f32(1, 1, 1, 128), f32(1, 64, 64),
                                  f32(1, 64, 64))
    bad = good._replace(x_inv=shape(1, 64, 64))
    with pytest.raises(ValueError, match=r"residuals.x_inv must be float32\[1, 64, 64\], got bfloat16\[1, 64, 64\]"):
        jax.eval_shape(lambda: gpu_bwd.chunk_kda_bwd(q, k, v, g, beta, 128**-0.5, do=v, interpret=True,
                                                     residuals=bad))


@pytest.mark.parametrize("batch, heads, want", [(1, 96, 1), (1, 66, 2), (1, 32, 2), (8, 32, 1)])
def test_default_v_split_keeps_the_state_pass_in_one_wave(batch, heads, want):
    assert mosaic_gpu.default_v_split(batch, heads, sms=132) == want


@pytest.mark.parametrize("packed", [False, True])
def test_lowers_to_two_mosaic_gpu_kernels_with_wgmma_on_a_cpu_host(packed):
    """Both kernels lower for sm_90 at two sequences of three heads, every copy between device and shared memory
    addressed with at most one integer index (the token tensors as ``[B * Tp, H, D]`` views, the rest flattened
    likewise): the addressing checked on the H200 at ``B > 1``. The first split kernels indexed ``[b, rows, h]``
    (and ``[b, h, c]``), right in the interpreter (which indexes the refs directly) and wrong on the H200 at
    ``B = 2, H = 3`` (benchmarks/ARCHIVE.md, 2026-12-02, s22-kda3). Packed: the per-chunk kernel's two token
    vectors are loaded the same way, and the backward's two fp32 residuals are written too."""
    s = jax.ShapeDtypeStruct
    args = (*(s((2, 200, 3, 128), jnp.bfloat16),) * 3, s((2, 200, 3, 128), jnp.float32), s((2, 200, 3), jnp.float32))
    if packed:
        args = (*args, s((2, 200), jnp.int32))
    fwd = lambda q, k, v, g, beta, *seg: mosaic_gpu.chunk_kda_fwd(q, k, v, g, beta, 128**-0.5, None, *seg, v_split=1,
                                                                  residuals=packed)
    text, int_indices = lower_for_sm90(fwd, *args)
    assert text.count("custom_call @mosaic_gpu") == 2
    assert "wgmma.mma_async" in text
    assert len(int_indices) >= 20 and max(int_indices) == 1, int_indices


def test_forward_lowers_under_jax_0112():
    """The two kernels also lower under the H200's JAX (0.11.2), where a lowering rule may differ."""
    if not os.path.exists(JAX_0112_PYTHON):
        pytest.skip(f"no jax 0.11.2 environment at {JAX_0112_PYTHON} (K3_JAX_0112_PYTHON)")
    out = run_under_jax_0112("""
        import jax, jax.numpy as jnp
        from pallas_kernels.kda import mosaic_gpu
        from tests._mosaic_gpu_lowering import lower_for_sm90
        s = jax.ShapeDtypeStruct
        tok = s((2, 200, 3, 128), jnp.bfloat16)
        args = (tok, tok, tok, s((2, 200, 3, 128), jnp.float32), s((2, 200, 3), jnp.float32))
        text, ints = lower_for_sm90(lambda *a: mosaic_gpu.chunk_kda_fwd(*a, 128**-0.5, v_split=1), *args)
        assert text.count("custom_call @mosaic_gpu") == 2 and max(ints) == 1, ints
    """)
    assert out.returncode == 0 and "ok 0.11.2" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype=jnp.float32), "bfloat16"),
    (dict(chunk_size=32), "chunk_size 64"),
])
def test_forward_rejects_calls_outside_its_contract(kwargs, match):
    q, k, v, g, beta, _ = _inputs(1, 64, 1, dtype=kwargs.get("dtype", jnp.bfloat16))
    with pytest.raises(ValueError, match=match):
        mosaic_gpu.chunk_kda_fwd(q, k, v, g, beta, 128**-0.5, chunk_size=kwargs.get("chunk_size", 64))


@pytest.mark.gpu
def test_gpu_per_chunk_kernel_matches_its_reference():
    skip_unless_hopper()
    q, k, _, g, beta, _ = _inputs(2, 256, 3, seed=7)
    beta_t = jnp.swapaxes(beta, 1, 2)
    for gate in (g, g * 0.01):
        got = intra_chunks(q, k, gate, beta_t, scale=128**-0.5)
        want = intra_chunks_reference(q, k, gate, beta_t, scale=128**-0.5)
        for name, a, b in zip(("qg", "kd", "wn", "x", "aqk"), got[:5], want[:5], strict=True):
            assert _rel(a, b) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H", [(1, 64, 2), (1, 128, 1), (1, 512, 1), (4, 64, 8)])
def test_gpu_per_chunk_kernel_at_the_defect_shapes(B, T, H):
    """The shapes (and inputs: seed ``T``, q not normalised) at which the H200 gave wrong ``A_qk`` / ``W`` / ``X'``
    while the kernel fed wgmma A operands from registers (benchmarks/RESULTS.md)."""
    skip_unless_hopper()
    from benchmarks.kda_mosaic_probe import inputs

    q, k, _, g, beta, _ = inputs(B, T, H, seed=T, normalize_q=False)
    beta_t = jnp.swapaxes(beta, 1, 2)
    got = intra_chunks(q, k, g, beta_t, scale=128**-0.5)
    want = intra_chunks_reference(q, k, g, beta_t, scale=128**-0.5)
    for name, a, b in zip(("qg", "kd", "wn", "x", "aqk"), got[:5], want[:5], strict=True):
        assert np.isfinite(np.asarray(a, np.float32)).all() and _rel(a, b) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, v_split", [(1, 256, 2, 1), (1, 256, 2, 2), (2, 300, 3, 1)])
def test_gpu_forward_matches_reference(B, T, H, v_split):
    skip_unless_hopper()
    q, k, v, g, beta, h0 = _inputs(B, T, H, seed=T)
    o, ht = mosaic_gpu.chunk_kda_fwd(q, k, v, g, beta, 128**-0.5, h0, v_split=v_split)
    ro, rh = _reference(q, k, v, g, beta, h0)
    assert _rel(o, ro) < 1e-2 and _rel(ht, rh) < 1e-2


BACKWARDS = ["kernel", "mosaic_gpu"]
"""The GPU tests' backwards of the Mosaic GPU forward: the Triton kernels, every step on Mosaic GPU."""


@pytest.mark.gpu
@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("B, T, H", [(1, 256, 2), (3, 200, 3), (1, 8192, 96)])
def test_gpu_gradients_match_reference(B, T, H, backward):
    """The Mosaic GPU forward with each backward (taking the forward's per-chunk results) against the VJP of the
    fp32 reference: one sequence, several, K3's shape."""
    skip_unless_hopper()
    _assert_gradients_match_reference(*_inputs(B, T, H, seed=1), backward=backward)


def _assert_gradients_match_reference(q, k, v, g, beta, h0, segment_ids=None, tol=2e-2, interpret=False,
                                      backward="auto"):
    """``mosaic_gpu`` forward + ``backward`` vs the VJP of the fp32 reference, within ``tol`` per input."""
    do = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.float32)

    def loss(impl, bwd, *a):
        o, ht = ops.chunk_kda(*a, initial_state=h0, output_final_state=True, segment_ids=segment_ids,
                              implementation=impl, interpret=interpret, platform="cpu" if interpret else "auto",
                              backward=bwd)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(ht)

    f = lambda x: x.astype(jnp.float32)
    got = jax.grad(lambda *a: loss("mosaic_gpu", backward, *a), argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
    want = jax.grad(lambda *a: loss("xla", "auto", *a), argnums=(0, 1, 2, 3, 4))(f(q), f(k), f(v), g, f(beta))
    for name, a, b in zip("q k v g beta".split(), got, want, strict=True):
        assert bool(jnp.isfinite(a).all()) and _rel(a, b) < tol, (name, _rel(a, b))


def _assert_aligned_keys_match_reference(interpret: bool, backward: str = "auto") -> None:
    """Aligned keys (:func:`_inputs`): the forward, the per-chunk ``X`` it hands the backward (against numpy's
    inverse of ``I + diag(beta) A_kk`` from its own ``A_kk``) and the gradients stay at the bf16-operand level (a
    Neumann product for ``X`` was off by ~1e25 here and trained a model into NaN)."""
    q, k, v, g, beta, h0 = _inputs(1, 128, 2, seed=5, aligned=True)
    o, ht, res = mosaic_gpu.chunk_kda_fwd(q, k, v, g, beta, 128**-0.5, h0, residuals=True, interpret=interpret)
    ro, rh = _reference(q, k, v, g, beta, h0)
    assert _rel(o, ro) < 3e-2 and _rel(ht, rh) < 3e-2, (_rel(o, ro), _rel(ht, rh))
    akk, x = np.asarray(res.akk[0, :64], np.float64), np.asarray(res.x_inv[0, :64], np.float64)
    b0 = np.asarray(beta[0, :64, 0], np.float64)
    exact = np.linalg.inv(np.eye(64) + b0[:, None] * akk)
    assert np.abs(exact).max() < 2 and _rel(x, exact) < 2e-2, (np.abs(exact).max(), _rel(x, exact))
    _assert_gradients_match_reference(q, k, v, g, beta, h0, tol=4e-2, interpret=interpret, backward=backward)


def test_interpreter_aligned_keys_match_reference():
    """:func:`_assert_aligned_keys_match_reference` on the Mosaic GPU interpreter (Triton backward interpreted)."""
    _assert_aligned_keys_match_reference(interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backward", BACKWARDS)
def test_gpu_aligned_keys_match_reference(backward):
    """:func:`_assert_aligned_keys_match_reference` on the H200."""
    skip_unless_hopper()
    _assert_aligned_keys_match_reference(interpret=False, backward=backward)


@pytest.mark.gpu
@pytest.mark.parametrize("backward", BACKWARDS)
def test_gpu_packed_forward_and_gradients_match_reference(backward):
    """Packed sequences on the H200 (documents starting inside chunks, at a chunk boundary and in the padded last
    chunk; two sequences of three heads): the forward and its gradients (Triton backward) against the fp32
    reference."""
    skip_unless_hopper()
    q, k, v, g, beta, h0 = _inputs(2, 300, 3, seed=5)
    seg = _documents(2, 300, [20, 50, 64, 130, 290])
    o, ht = mosaic_gpu.chunk_kda_fwd(q, k, v, g, beta, 128**-0.5, h0, segment_ids=seg)
    ro, rh = _reference(q, k, v, g, beta, h0, seg)
    assert _rel(o, ro) < 1e-2 and _rel(ht, rh) < 1e-2
    _assert_gradients_match_reference(q, k, v, g, beta, h0, seg, backward=backward)
