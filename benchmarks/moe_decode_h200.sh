#!/usr/bin/env bash
# One device call for the MXFP4 expert kernels in decode (issues 22/23): two trees side by side on one GPU.
#
#   OLD=/path/to/old/tree NEW=/path/to/new/tree OUT=/path/to/out TOTAL_S=200 bash benchmarks/moe_decode_h200.sh
#
# Under the GPU env of benchmarks/RESULTS.md, every GPU section holds K3_BENCH_LOCK (compiles run in parallel,
# timings one at a time): benchmarks/moe.py --parts decode of the new tree (its tile sweeps, expert FFN, routed
# steps) then of the old tree (its default tiles: the same-run peer; MOE_OLD=0 skips it); the new tree's GPU tests
# of the MXFP4 kernels and their callers; benchmarks/decode.py on configs/k3-slice.json with MXFP4 experts at batch 64 and 1 (prompt 128,
# 8 steps per call; the new tree's batch 64 profiled) in both trees. Outputs under $OUT (written as they run):
# moe_new.out / moe_old.out, new.jsonl / old.jsonl (decode.py), gpu_tests.out, stderr.txt; a summary is printed last
# (decode rows with their greedy tokens compared to the old tree's).
set -u
: "${OLD:?} ${NEW:?} ${OUT:?}"
T=${TOTAL_S:-200}
export XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false" K3_COMPILATION_CACHE=off \
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 K3_BENCH_LOCK=/tmp/k3_bench.lock
RUNS=$OUT  # written as they run: a call cut short still returns what finished
ERRS=/tmp/k3_moe_err
mkdir -p "$ERRS/prof"

decode() {  # name tree args...: one decode.py process in the background (takes the lock itself)
  local name=$1 dir=$2
  shift 2
  (cd "$dir" && PYTHONPATH="$dir" timeout "$T" python3 benchmarks/decode.py --experts mxfp4 --label "$name" "$@" \
    >"$RUNS/$name.jsonl" 2>"$ERRS/$name.err") &
}

locked() {  # name tree seconds command...: one command in a tree, holding the lock
  local name=$1 dir=$2 s=$3
  shift 3
  (cd "$dir" && PYTHONPATH="$dir" flock "$K3_BENCH_LOCK" timeout "$s" "$@" >"$RUNS/$name.out" 2>"$ERRS/$name.err")
}

PROF="--profile-batches 64 --profile-calls 1"
decode new "$NEW" --cases 64:128:8,1:128:8 $PROF --profile-dir "$ERRS/prof/new"
decode old "$OLD" --cases 64:128:8,1:128:8
(
  locked moe_new "$NEW" "${MOE_T:-90}" python3 benchmarks/moe.py --parts decode --budget-decode "${MOE_S:-50}"
  locked gpu_tests "$NEW" "${TESTS_T:-80}" python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_moe_gpu_mxfp4.py \
    tests/test_moe_stacked_layer.py tests/test_decode_small_ops.py
  if [ "${MOE_OLD:-1}" = 1 ]; then
    locked moe_old "$OLD" 50 python3 benchmarks/moe.py --parts decode --budget-decode "${MOE_OLD_S:-20}" \
      --mx-tiles 16,128,64,4,4
  fi
) &
wait

for f in "$ERRS"/*.err; do echo "== $f"; tail -n 6 "$f"; done >"$OUT/stderr.txt"
tail -n 3 "$OUT/gpu_tests.out"
cat "$OUT"/moe_*.out >"$ERRS/moe.jsonl"
cat "$OUT"/new.jsonl "$OUT"/old.jsonl >"$ERRS/decode.jsonl"
python3 - "$ERRS/moe.jsonl" "$ERRS/decode.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        if "peer" in r or "best_mx" in r or "kernels" in r:
            keep = ("peer", "case", "ms", "gbps", "pct_hbm", "tiles", "rel_err_vs_ref", "rel_err_ours_vs_ref",
                    "live_experts", "best_mx", "error", "skipped", "kernels")
            print({k: r[k] for k in keep if k in r})
first = {}
for line in open(sys.argv[2]):
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    if "error" in r:
        print(r.get("label"), r.get("batch"), "ERROR", r["error"][:300])
    elif "ms_per_step" in r:
        key = (r["batch"], r["prompt_len"])
        ref = first.setdefault(key, (r["label"], r["tokens"]))
        diff = sum(a != b for x, y in zip(ref[1], r["tokens"]) for a, b in zip(x, y))
        print(f'{r["label"]:4s} b{r["batch"]:<3d} {r["ms_per_step"]:8.3f} ms {r["tokens_per_s"]:9.1f} tok/s frac '
              f'{r["roofline_fraction"]:.3f} GB {r["bytes"]["total"] / 1e9:.2f} copy {r["copy_gbps"]:.0f} '
              f'tokens {r["tokens_sha1"]}: {diff} differ from {ref[0]}')
        p = r.get("profile")
        if p and "top" in p:
            print("   profile: device", p["device_busy_ms_per_step"], "ms, events", p["events_per_step"])
            for name, ms, count in p["top"][:8]:
                print(f"     {ms:7.4f} {count:4d} {name[:90]}")
PY
