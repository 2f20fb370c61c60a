#!/usr/bin/env bash
# One device call for issue 22's Mosaic GPU MoE kernels (pallas_kernels/moe/mosaic_gpu_mxfp4.py, mosaic_gpu_glu.py):
# their GPU tests first, then benchmarks/moe.py with the Triton kernels and dense matmuls as peers in each process.
#
#   OUT=/path/to/out [TOTAL_S=540] bash benchmarks/moe_mosaic_gpu_h200.sh
#
# Sections, each on unless its variable is 0 (budgets in seconds):
#   TESTS   `-m gpu` of tests/test_moe_mosaic_gpu*.py (the MXFP4 kernel in its three decode modes at K3 widths,
#           the fused GLU kernel at K3 shapes, the mosaic_gpu expert FFN with gradients); 240.
#   DECODE  `--parts decode` at 64 experts x 8 rows and k3-slice's 16 x 16: the HBM copy, the Triton MXFP4 kernels
#           at their own tiles and FFN, the Mosaic GPU MXFP4 kernel over `--mx-mgpu-tiles` (w1, fused w1/w3) and
#           its FFN, K3 routing; $DECODE_S (120).
#   GLU     `--parts glu`: the fused w1/w3 + SiTU-GLU kernel over `--glu-blocks` vs the unfused Mosaic GPU and
#           Triton products and dense matmuls; $GLU_S (90).
#   FFN     `--parts ffn`: the expert FFN forward and forward + backward, `mosaic_gpu` (fused) vs
#           `mosaic_gpu_unfused` vs `triton` (ours) vs dense; $FFN_S (120).
# Every JSON line goes to $OUT/runs.jsonl (a call cut short returns what finished), stderr tails to $OUT/stderr.txt.
set -u
: "${OUT:?}"
cd "$(dirname "$0")/.."
export XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false" K3_COMPILATION_CACHE=off \
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
START=$SECONDS
TOTAL_S=${TOTAL_S:-540}
left() { echo $((TOTAL_S - (SECONDS - START))); }

bench() {  # label budget args...: one benchmarks/moe.py process, its JSON lines labelled into runs.jsonl
  local label=$1 s=$2
  shift 2
  if [ "$(left)" -lt 30 ]; then echo "== skip $label: $(left) s left"; return; fi
  [ "$s" -gt "$(left)" ] && s=$(left)
  echo "== $(date +%T) $label (${s} s)"
  timeout "$s" python3 benchmarks/moe.py "$@" 2>"/tmp/k3_moe_$label.err" | sed "s/^{/{\"label\": \"$label\", /" \
    | tee -a "$OUT/runs.jsonl" | cut -c1-300
  { echo "== $label"; tail -5 "/tmp/k3_moe_$label.err"; } >>"$OUT/stderr.txt"
}

if [ "${TESTS:-1}" = 1 ]; then
  echo "== $(date +%T) tests"
  timeout 240 python3 -m pytest -q -m gpu tests/test_moe_mosaic_gpu.py tests/test_moe_mosaic_gpu_mxfp4.py \
    tests/test_moe_mosaic_gpu_glu.py -n 4 --timeout=200 -p no:cacheprovider >"$OUT/gpu_tests.txt" 2>&1
  tail -15 "$OUT/gpu_tests.txt"
fi
DECODE_S=${DECODE_S:-120} GLU_S=${GLU_S:-90} FFN_S=${FFN_S:-120}
# the Triton kernels at their own tiles only (their sweeps are in RESULTS.md): the time goes to the Mosaic GPU sweep
[ "${DECODE:-1}" = 1 ] && bench decode $((DECODE_S + 15)) --parts decode --budget-decode "$DECODE_S" \
  --decode-cases 64x8,16x16 --mx-tiles "8,128,64,4,3;16,64,64,4,3;32,64,64,4,3" \
  --mx-glu-tiles "8,64,64,4,3;16,64,64,4,3;32,64,64,4,3"
[ "${GLU:-1}" = 1 ] && bench glu $((GLU_S + 15)) --parts glu --budget-glu "$GLU_S"
[ "${FFN:-1}" = 1 ] && bench ffn $((FFN_S + 15)) --parts ffn --budget-ffn "$FFN_S"
echo "== $(date +%T) done ($((SECONDS - START)) s)"
