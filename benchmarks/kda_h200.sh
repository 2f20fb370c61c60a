#!/usr/bin/env bash
# One device call for issue 22's KDA chunk kernels: GPU tests, then forward and forward + backward against fla at
# the three benchmark shapes, with the backward taking the Mosaic forward's per-chunk results or recomputing them.
#
#   NEW=/path/to/tree OUT=/path/to/out [OLD=/old/tree] [FLA_AUTOTUNE=fla_autotune.tar] bash benchmarks/kda_h200.sh
#
# Needs fla (`fla-core`, carried as a wheel where the machine lacks it) importable. fla autotunes its kernels in each
# new process (minutes at the first shape of each head count) and stores the results as `*.autotune.json` files
# under TRITON_CACHE_DIR: $FLA_AUTOTUNE (a tar of them; default benchmarks/fla_autotune_h200.tar.gz, fla-core 0.6.0
# with the H200 image's Triton 3.6 at H = 96 and 32) is unpacked first, and the files are written back to
# $OUT/fla_autotune.tar at the end, for the next call. Sections, each on unless its variable is 0:
#   TESTS   the KDA GPU tests of the new tree (Mosaic GPU forward and backward steps, Triton kernels, taps).
#   K3      1x8192x96: $K3_IMPLS (default mosaic_gpu, mosaic_gpu/mosaic_gpu = its backward with every step on
#           Mosaic GPU, triton), device traces with the timeline (idle gaps) of the first.
#   H32     8x4096x32 and 1x32768x32 (one process: fla's tuning keys on H): mosaic_gpu, device traces with the
#           timeline.
#   DECODE  the decode step at B=64, H=96 (benchmarks/kda.py's decode bench: the Triton kernel, the Mosaic GPU ring
#           at each of $MOSAIC_DECODE (default: kda.py's --mosaic-decode-configs), fla's fused_recurrent_kda), the
#           Triton kernel's device trace; first, before the chunk shapes.
#   FUSED   the layer's decode step from its projections (benchmarks/kda_fused_decode.py: the fused Triton kernel,
#           the unfused path, fla's causal_conv1d_update + fused_recurrent_kda) at B=64 and 1, H=96, after DECODE;
#           its JSON lines go to $OUT/fused_decode.jsonl. The tests add tests/test_kda_fused_decode.py.
#   OLD     with $OLD set: K3 and H32 in that tree (its own defaults), after the new tree's.
# Every benchmarks/kda.py JSON line goes to $OUT/runs.jsonl (a call cut short returns what finished); the last lines
# of each process's stderr to $OUT/stderr.txt.
set -u
: "${NEW:?} ${OUT:?}"
export XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false" K3_COMPILATION_CACHE=off \
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 \
  TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/k3_triton_cache}
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
FLA_AUTOTUNE=${FLA_AUTOTUNE:-$NEW/benchmarks/fla_autotune_h200.tar.gz}
[ -f "$FLA_AUTOTUNE" ] && tar xf "$FLA_AUTOTUNE" -C "$TRITON_CACHE_DIR"
PROF=/tmp/k3_kda_prof
COMMON="--no-reference --no-decode --profile-dir $PROF"

bench() {  # label tree seconds args...: one benchmarks/kda.py process, its JSON line labelled into runs.jsonl
  local label=$1 dir=$2 s=$3
  shift 3
  echo "== $(date +%T) $label"
  (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" timeout "$s" python3 benchmarks/kda.py "$@" \
    2>"/tmp/k3_kda_$label.err" | grep '^{"device"' | tail -1 | sed "s/^{/{\"label\": \"$label\", /" | tee -a "$OUT/runs.jsonl")
  { echo "== $label"; tail -5 "/tmp/k3_kda_$label.err"; } >>"$OUT/stderr.txt"
}

if [ "${TESTS:-1}" = 1 ]; then
  echo "== $(date +%T) tests"
  (cd "$NEW" && timeout 300 python3 -m pytest -q -m gpu tests/test_kda_mosaic_gpu.py tests/test_kda_ops.py \
    tests/test_kda_mosaic_gpu_taps.py tests/test_kda_mosaic_gpu_bwd_sweeps.py tests/test_kda_mosaic_gpu_bwd_dqkw.py \
    tests/test_kda_mosaic_gpu_bwd_wy.py tests/test_kda_mosaic_gpu_bwd_da.py tests/test_kda_fused_decode.py -n 4 \
    --timeout=240 -p no:cacheprovider \
    >"$OUT/gpu_tests.txt" 2>&1)
  tail -3 "$OUT/gpu_tests.txt"
fi
if [ "${DECODE:-1}" = 1 ]; then
  bench new_decode "$NEW" 200 --shapes "" --decode-first --profile-dir $PROF \
    ${MOSAIC_DECODE:+--mosaic-decode-configs "$MOSAIC_DECODE"}
fi
if [ "${FUSED:-1}" = 1 ]; then
  echo "== $(date +%T) fused decode"
  (cd "$NEW" && PYTHONPATH="$NEW${PYTHONPATH:+:$PYTHONPATH}" timeout 200 python3 benchmarks/kda_fused_decode.py \
    --batches 64,1 2>/tmp/k3_kda_fused.err | tee -a "$OUT/fused_decode.jsonl")
  { echo "== fused"; tail -5 /tmp/k3_kda_fused.err; } >>"$OUT/stderr.txt"
fi
trees=("new:$NEW")
[ -n "${OLD:-}" ] && trees+=("old:$OLD")
for entry in "${trees[@]}"; do
  name=${entry%%:*} dir=${entry#*:}
  if [ "${K3:-1}" = 1 ]; then
    if [ "$name" = new ]; then
      bench new_k3 "$dir" 300 --shapes 1x8192x96 --impls "${K3_IMPLS:-mosaic_gpu,mosaic_gpu/mosaic_gpu,triton}" $COMMON
    else
      bench old_k3 "$dir" 240 --shapes 1x8192x96 --impls mosaic_gpu,triton $COMMON
    fi
  fi
  if [ "${H32:-1}" = 1 ]; then
    if [ "$name" = new ]; then
      bench new_h32 "$dir" 300 --shapes 8x4096x32,1x32768x32 --impls mosaic_gpu $COMMON
    else
      bench old_h32 "$dir" 200 --shapes 8x4096x32,1x32768x32 --impls mosaic_gpu --no-reference --no-decode
    fi
  fi
done
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar cf "$OUT/fla_autotune.tar" -T -)
echo "== $(date +%T) done"
