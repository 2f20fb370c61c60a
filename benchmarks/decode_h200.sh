#!/usr/bin/env bash
# One device call for issue 23: the decode step of two trees side by side on one GPU, plus the release's layers.
#
#   OLD=/path/to/old/tree NEW=/path/to/new/tree OUT=/path/to/out TOTAL_S=170 bash benchmarks/decode_h200.sh
#
# Every process runs benchmarks/decode.py of its own tree under the GPU env of benchmarks/RESULTS.md; they compile
# in parallel and time one at a time under K3_BENCH_LOCK. Cases: k3-slice batch 64 and 1 (prompt 128, 8 steps per
# call), bf16 and MXFP4 experts, in both trees (the batch-64 bf16 case profiled in both); the release's KDA and MLA
# layers (configs/k3.json, 896 MXFP4 experts top-16, vocabulary 1,024, prompt 1,024) at batch 64 and 1 in the new
# tree (the KDA layer profiled; a third release-layer process does not fit in the GPU's memory beside these). The
# new tree's router-selection and sampling tests run on the GPU in the same call, holding the lock. An old tree
# whose decode.py holds the lock through its init compiles makes the others wait for them: give the call more time.
# Outputs under $OUT: runs.jsonl (every JSON line), stderr.txt (each process's last lines), gpu_tests.txt,
# new_b64_bf16.hlo.txt (the new tree's optimised batch-64 bf16 step), traces.tgz (the Perfetto traces); a summary
# table is printed last.
set -u
: "${OLD:?} ${NEW:?} ${OUT:?}"
T=${TOTAL_S:-170}
export XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false" K3_COMPILATION_CACHE=off \
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 K3_BENCH_LOCK=/tmp/k3_bench.lock
PROF=/tmp/k3_decode_prof
mkdir -p "$PROF" /tmp/k3_decode_runs
RUNS=/tmp/k3_decode_runs

run() {  # name tree args...: one decode.py process in the background
  local name=$1 dir=$2
  shift 2
  (cd "$dir" && PYTHONPATH="$dir" timeout "$T" python3 benchmarks/decode.py "$@" --label "$name" \
    >"$RUNS/$name.jsonl" 2>"$RUNS/$name.err") &
}

SLICE="--cases 64:128:8,1:128:8"
REL="--config configs/k3.json --vocab 1024 --experts mxfp4"
run new_bf16 "$NEW" $SLICE --experts bf16 --profile-dir "$PROF/new_bf16" --profile-calls 1 \
  --hlo-out "$OUT/new_b64_bf16.hlo.txt"
run old_bf16 "$OLD" $SLICE --experts bf16 --profile-dir "$PROF/old_bf16" --profile-calls 1
run new_mxfp4 "$NEW" $SLICE --experts mxfp4
run old_mxfp4 "$OLD" $SLICE --experts mxfp4
run new_rel_kda "$NEW" $REL --layers kda --cases 64:1024:8,1:1024:8 --profile-dir "$PROF/new_rel_kda" \
  --profile-calls 1
run new_rel_mla "$NEW" $REL --layers mla --cases 64:1024:8,1:1024:8
(cd "$NEW" && PYTHONPATH="$NEW" flock "$K3_BENCH_LOCK" timeout 90 python3 -m pytest -q -p no:cacheprovider \
  tests/test_router_select.py tests/test_sampling.py >"$OUT/gpu_tests.txt" 2>&1) &
wait

cat "$RUNS"/*.jsonl >"$OUT/runs.jsonl"
for f in "$RUNS"/*.err; do echo "== $f"; tail -n 5 "$f"; done >"$OUT/stderr.txt"
(cd "$PROF" && find . -name '*.json.gz' | tar czf "$OUT/traces.tgz" -T -)
tail -n 3 "$OUT/gpu_tests.txt"
python3 - "$OUT/runs.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    if "error" in r:
        print(r.get("label"), r.get("experts"), r.get("batch"), "ERROR", r["error"][:300])
    elif "ms_per_step" in r:
        print(f'{r["label"]:12s} {r["experts"]:5s} b{r["batch"]:<3d} {r["ms_per_step"]:8.3f} ms '
              f'{r["tokens_per_s"]:9.1f} tok/s frac {r["roofline_fraction"]:.3f} GB {r["bytes"]["total"] / 1e9:.2f} '
              f'copy {r["copy_gbps"]:.0f} compile {r["compile_s"]}s')
        p = r.get("profile")
        if p and "top" in p:
            print("   profile: device", p["device_busy_ms_per_step"], "ms, events", p["events_per_step"],
                  "copies", p["copy_ms_per_step"], "concat", p.get("concatenate_ms_per_step"),
                  "sort", p.get("sort_ms_per_step"))
            for name, ms, count in p["top"][:12]:
                print(f"     {ms:7.4f} {count:4d} {name[:90]}")
EOF
