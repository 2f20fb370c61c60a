"""Compiling for an H200 on a host without a GPU (``benchmarks/gpu_aot.py``): the report parsers on fixed text, and
the Mosaic GPU kernels compiled by ``ptxas`` for sm_90a with no spills and no serialised wgmma.

The compile tests need a Python with JAX's CUDA plugin of the H200's JAX (``tests._mosaic_gpu_lowering.
CUDA_AOT_PYTHON``, a venv with ``jax[cuda13]==0.11.2`` and this project); they skip, saying so, where it is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.gpu_aot import kernel_launches, launches_by_scope, ptxas_reports
from tests._mosaic_gpu_lowering import CUDA_AOT_PYTHON, cuda_aot_missing_reason

REPO = Path(__file__).resolve().parents[1]

PTXAS = """\
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient \
register resources for the wgmma pipeline in the function 'k_a'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_a' for 'sm_90a'
ptxas info    : Function properties for k_a
    8 bytes stack frame, 4 bytes spill stores, 6 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 1 bytes smem
ptxas info    : Compiling entry function 'k_b' for 'sm_90a'
ptxas info    : Function properties for k_b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
"""

HLO = """\
HloModule m

%fused_add.3 (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  ROOT %a = s32[] add(%p, %p)
}

%body.1 (arg: (s32[], f32[8])) -> (s32[], f32[8]) {
  %arg = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[8]{0} get-tuple-element(%arg), index=1
  %loop_add_fusion = s32[] fusion(%i), kind=kLoop, calls=%fused_add.3
  %cc = f32[8]{0} custom-call(%x), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/l/kda_decode/mpmd_map"}
  %start = ((f32[8]{0}), f32[8]{0}, u32[]) copy-start(%cc)
  %done = f32[8]{0} copy-done(%start)
  ROOT %t = (s32[], f32[8]) tuple(%loop_add_fusion, %done)
}

%cond.1 (arg: (s32[], f32[8])) -> pred[] {
  %arg = (s32[], f32[8]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[8]) tuple(%z, %x)
  %w = (s32[], f32[8]) while(%t), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"3"}}
  %g = f32[8]{0} custom-call(%x), custom_call_target="__cublas$lt$matmul"
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_ptxas_reports_parse_registers_spills_and_advisories():
    a, b = ptxas_reports(PTXAS.splitlines())
    assert a["kernel"] == "k_a" and a["arch"] == "sm_90a" and a["registers"] == 255
    assert (a["stack"], a["spill_stores"], a["spill_loads"]) == (8, 4, 6)
    assert len(a["warnings"]) == 1 and a["warnings"][0].startswith("C7511")
    assert b["kernel"] == "k_b" and b["registers"] == 168 and b["barriers"] == 16 and b["warnings"] == []
    assert b["spill_stores"] == b["spill_loads"] == 0


def test_kernel_launches_count_loop_bodies_by_their_trips():
    launches = kernel_launches(HLO)
    assert launches == {"fusion:add": 3, "pallas:kda_decode": 3, "copy-start": 3, "gemm": 1}


def test_launches_by_scope_group_the_layers_of_a_scan():
    assert launches_by_scope(HLO) == {"?": 7, "l/kda_decode": 3}
    layered = HLO.replace('op_name="jit(f)/l/kda_decode/mpmd_map"',
                          'op_name="jit(f)/m/while/body/eval_jaxpr/segment_0/layer_0/attn/kda_decode/mpmd_map"')
    assert launches_by_scope(layered, depth=1) == {"?": 7, "attn": 3}


CLEAN = ("kda_fwd", "kda_fwd_bwd", "kda_decode", "moe_glu", "moe_mxfp4")
"""Cases whose every Mosaic GPU kernel compiles with no spill and no ``ptxas`` performance advisory."""


@pytest.mark.parametrize("case", CLEAN)
def test_mosaic_gpu_kernels_compile_for_sm90a_without_spills(case):
    if reason := cuda_aot_missing_reason():
        pytest.skip(reason)
    out = subprocess.run([CUDA_AOT_PYTHON, str(REPO / "benchmarks" / "gpu_aot.py"), "--kernels", case],
                         capture_output=True, text=True, timeout=900, cwd=REPO,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "MOSAIC_GPU_DUMP_PTXAS": "1",
                              "PYTHONPATH": str(REPO)})
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    summary = [r for r in lines if "compiled" in r]
    assert summary and summary[0]["compiled"], (summary, out.stderr[-2000:])
    kernels = [r for r in lines if "kernel" in r]
    assert kernels and len(kernels) == summary[0]["mosaic_gpu_kernels"]
    for r in kernels:
        assert r["spill_stores"] == r["spill_loads"] == 0, r
        assert not [w for w in r["warnings"] if w.startswith(("C7511", "C7512"))], r
