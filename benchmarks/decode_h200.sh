#!/usr/bin/env bash
# One device call for issues 22/23: the decode step (and the MXFP4 expert kernels) of two trees side by side on one
# GPU, then the release's layers.
#
#   OLD=/path/to/old/tree NEW=/path/to/new/tree OUT=/path/to/out TOTAL_S=100 bash benchmarks/decode_h200.sh
#
# Every process runs the benchmarks of its own tree under the GPU env of benchmarks/RESULTS.md; they compile in
# parallel and time one at a time under K3_BENCH_LOCK (benchmarks/decode.py takes the lock itself; moe.py and the
# GPU tests hold it for their whole run). Sections, each on unless its variable is 0:
#   BF16      k3-slice, bf16 experts, 8 steps per call: batch 64, 1, 256 (prompt 128; the old tree's batch 256
#             twice, a determinism check) and batch 16 at prompt 32,768; batch 64 and 1 profiled; both trees.
#   MXFP4     k3-slice, MXFP4 experts: batch 64 and 1 (prompt 128), both trees, the new tree's batch 64 profiled.
#   MOE       (off unless MOE=1) benchmarks/moe.py --parts decode in the new tree with $MOE_ARGS (its tile sweeps,
#             expert FFN, routed steps), then in the old tree with $MOE_OLD_ARGS (MOE_OLD=0 skips it).
#   TESTS     the new tree's GPU tests: the files in $TESTS (default: the small decode ops and sampling; TESTS=0:
#             none).
#   RELEASE_LAYERS  second wave (after the first, for the GPU's memory; RELEASE_LAYERS=wave1: in the first, when
#             the first wave's processes leave room): the release's KDA and MLA layers (configs/k3.json, 896 MXFP4
#             experts top-16, vocabulary 1,024, prompt 1,024) at $RELEASE_CASES (default batch 64 and 1) in the
#             new tree, the KDA layer profiled at each batch.
# $EXTRA, if set, is evaluated in the first wave (e.g. `run name tree args...`: one more decode.py process).
# Outputs under $OUT, written as they run (a call cut short still returns what finished): runs.jsonl (every
# decode.py JSON line), moe_new.jsonl / moe_old.jsonl, gpu_tests.txt, stderr.txt (each process's last lines),
# traces.tgz (the Perfetto traces); with BF16, new_b64_bf16.hlo.txt (the new tree's optimised batch-64 bf16 step).
# A summary is printed last: the moe.py lines, and each decode case with its greedy tokens (the first call's
# [8, B]) compared to the old tree's run of that case (else the first run's): positions that differ.
set -u
shopt -s nullglob
: "${OLD:?} ${NEW:?} ${OUT:?}"
T=${TOTAL_S:-100}
export XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false" K3_COMPILATION_CACHE=off \
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 K3_BENCH_LOCK=/tmp/k3_bench.lock
PROF=/tmp/k3_decode_prof
RUNS=/tmp/k3_decode_runs
mkdir -p "$PROF" "$RUNS" "$OUT"

run() {  # name tree args...: one decode.py process in the background
  local name=$1 dir=$2
  shift 2
  (cd "$dir" && PYTHONPATH="$dir" timeout "$T" python3 benchmarks/decode.py "$@" --label "$name" \
    >"$RUNS/$name.jsonl" 2>"$RUNS/$name.err") &
}

locked() {  # name tree seconds command...: one command in a tree, holding the lock, output to $OUT/name
  local name=$1 dir=$2 s=$3
  shift 3
  (cd "$dir" && PYTHONPATH="$dir" flock "$K3_BENCH_LOCK" timeout "$s" "$@" >"$OUT/$name" 2>"$RUNS/$name.err")
}

PROFILE="--profile-batches 64,1 --profile-calls 1"
if [ "${BF16:-1}" = 1 ]; then
  run new_bf16 "$NEW" --cases 64:128:8,1:128:8,256:128:8,16:32768:8 --experts bf16 $PROFILE \
    --profile-dir "$PROF/new_bf16" --hlo-out "$OUT/new_b64_bf16.hlo.txt"
  run old_bf16 "$OLD" --cases 64:128:8,1:128:8,256:128:8,256:128:8,16:32768:8 --experts bf16 $PROFILE \
    --profile-dir "$PROF/old_bf16"
fi
if [ "${MXFP4:-1}" = 1 ]; then
  run new_mxfp4 "$NEW" --cases 64:128:8,1:128:8 --experts mxfp4 --profile-batches 64 --profile-calls 1 \
    --profile-dir "$PROF/new_mxfp4"
  run old_mxfp4 "$OLD" --cases 64:128:8,1:128:8 --experts mxfp4
fi
(
  if [ "${MOE:-0}" = 1 ]; then
    locked moe_new.jsonl "$NEW" "${MOE_T:-60}" python3 benchmarks/moe.py --parts decode ${MOE_ARGS:-}
    if [ "${MOE_OLD:-1}" = 1 ]; then
      locked moe_old.jsonl "$OLD" "${MOE_T:-60}" python3 benchmarks/moe.py --parts decode ${MOE_OLD_ARGS:-}
    fi
  fi
  if [ "${TESTS:-}" != 0 ]; then
    locked gpu_tests.txt "$NEW" "${TESTS_T:-60}" python3 -m pytest -q -p no:cacheprovider -n "${TESTS_N:-4}" \
      ${TESTS:-tests/test_decode_small_ops.py tests/test_sampling.py}
  fi
) &
release() {  # the release's KDA and MLA layers in the new tree
  local rel="--config configs/k3.json --vocab 1024 --experts mxfp4 --cases ${RELEASE_CASES:-64:1024:8,1:1024:8}"
  run new_rel_kda "$NEW" $rel --layers kda $PROFILE --profile-dir "$PROF/new_rel_kda"
  run new_rel_mla "$NEW" $rel --layers mla
}
if [ "${RELEASE_LAYERS:-1}" = wave1 ]; then release; fi
if [ -n "${EXTRA:-}" ]; then eval "$EXTRA"; fi
wait

if [ "${RELEASE_LAYERS:-1}" = 1 ]; then
  release
  wait
fi

cat /dev/null "$RUNS"/old_*.jsonl "$RUNS"/new*.jsonl >"$OUT/runs.jsonl"
for f in "$RUNS"/*.err; do echo "== $f"; tail -n 4 "$f"; done >"$OUT/stderr.txt"
(cd "$PROF" && find . -name 'perfetto_trace.json.gz' | tar czf "$OUT/traces.tgz" -T -)
[ -f "$OUT/gpu_tests.txt" ] && tail -n 2 "$OUT/gpu_tests.txt"
python3 - "$OUT/runs.jsonl" "$OUT"/moe_*.jsonl <<'PY'
import json, sys
for path in sys.argv[2:]:
    print("==", path.rsplit("/", 1)[-1])
    for line in open(path):
        if line.startswith("{"):
            r = json.loads(line)
            if "peer" in r or "best_mx" in r or "kernels" in r:
                keep = ("peer", "case", "ms", "gbps", "pct_hbm", "tiles", "rel_err_vs_ref", "rel_err_ours_vs_ref",
                        "live_experts", "error", "skipped", "kernels")
                print({k: r[k] for k in keep if k in r})
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
first = {}
for r in rows:
    if "error" in r:
        print(r.get("label"), r.get("experts"), r.get("batch"), "ERROR", r["error"][:300])
    elif "ms_per_step" in r:
        key = (r["layers"], r["experts"], r["batch"], r["prompt_len"])
        ref = first.setdefault(key, (r["label"], r["tokens"]))
        diff = sum(a != b for x, y in zip(ref[1], r["tokens"]) for a, b in zip(x, y))
        hit = r.get("experts_hit") or {}
        frac = "n/a (experts not counted)" if r.get("roofline_fraction") is None else f'{r["roofline_fraction"]:.3f}'
        gb = "n/a" if not r.get("bytes") else f'{r["bytes"]["total"] / 1e9:.2f}'
        print(f'{r["label"]:11s} {r["experts"]:5s} b{r["batch"]:<3d} p{r["prompt_len"]:<5d} {r["ms_per_step"]:8.3f} ms '
              f'{r["tokens_per_s"]:9.1f} tok/s frac {frac} (uniform routing {r.get("roofline_fraction_uniform")}) '
              f'GB {gb} experts hit {hit.get("mean", hit.get("error"))} of uniform {hit.get("uniform_expected")} '
              f'copy {r["copy_gbps"]:.0f} tokens {r["tokens_sha1"]}: {diff} differ from {ref[0]}')
        p = r.get("profile")
        if p and "top" in p:
            t = p.get("timeline", {})
            print("   profile: device", p["device_busy_ms_per_step"], "ms, events", p["events_per_step"], "span",
                  t.get("span_ms"), "idle", t.get("idle_ms"), "d2h", t.get("d2h_copies"), "concat",
                  p.get("concatenate_ms_per_step"), "sort", p.get("sort_ms_per_step"))
            for name, ms, count in p["top"][:8]:
                print(f"     {ms:7.4f} {count:4d} {name[:80]}")
PY
