#!/usr/bin/env bash
# Issue 21's speculative-decoding measurement in one device call (the device machine keeps no files between
# calls): train a k3-small target on the bundled corpus, then an LK and a CE draft against it (two processes at
# once), and benchmark SpeculativeEngine against the plain Engine (benchmarks/speculative.py). The benchmark
# starts with the target's training: it compiles every case on random weights of the same shapes meanwhile and
# swaps the trained weights in once the drafts are written, so no compile runs beside its timed runs.
#
#   OUT=/tmp/spec bash benchmarks/speculative_h200.sh                  # H200 defaults (about 300 s)
#   CONFIG=configs/k3-tiny.json TARGET_STEPS=4 ... bash benchmarks/speculative_h200.sh   # CPU smoke
#
# Every knob is an environment variable (defaults below). Output in $OUT: bench.jsonl (one JSON line per case,
# then a summary), bench.log, target.log, draft_lk.log, draft_ce.log; the last lines of each are printed.
set -u
cd "$(dirname "$0")/.."
: "${PY:=python3}" "${OUT:=/tmp/spec_out}" "${WORK:=/tmp/spec_work}" "${CONFIG:=configs/k3-small.json}"
: "${TOTAL_S:=310}"                       # the whole pipeline's wall-time budget
: "${TARGET_STEPS:=400}" "${TARGET_BATCH:=8}" "${TARGET_SEQ:=512}" "${TARGET_LIMIT_S:=170}"
: "${DRAFT_STEPS:=400}" "${DRAFT_BATCH:=8}" "${DRAFT_SEQ:=512}" "${DRAFT_MAX_S:=70}" "${DRAFT_TTT:=3}"
: "${BATCHES:=1,4,16}" "${KS:=2,4,6}" "${PROMPT_LEN:=65}" "${NEW_TOKENS:=128}" "${REPEATS:=2}"
: "${SAMPLE_BATCHES:=1}" "${COMPILE_THREADS:=4}" "${BENCH_RESERVE_S:=15}"
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
start=$(date +%s)

timeout -s KILL "$TOTAL_S" "$PY" benchmarks/speculative.py --config "$CONFIG" --target "$WORK/target" \
    --drafts "lk=$WORK/lk/draft,ce=$WORK/ce/draft" --batches "$BATCHES" --ks "$KS" --prompt-len "$PROMPT_LEN" \
    --new-tokens "$NEW_TOKENS" --repeats "$REPEATS" --sample-batches "$SAMPLE_BATCHES" \
    --compile-threads "$COMPILE_THREADS" --compile-cache "$WORK/xla" \
    --wait-s "$((TOTAL_S - BENCH_RESERVE_S))" --deadline-s "$((TOTAL_S - BENCH_RESERVE_S))" \
    >"$OUT/bench.jsonl" 2>"$OUT/bench.log" &
bench=$!

K3_COMPILATION_CACHE=off timeout -s TERM "$TARGET_LIMIT_S" "$PY" train.py --config "$CONFIG" \
    --workdir "$WORK/target" --steps "$TARGET_STEPS" --batch-size "$TARGET_BATCH" --seq-len "$TARGET_SEQ" \
    --eval-every 0 --quiet --no-resume >"$OUT/target.log" 2>&1
echo "target: rc $? at $(($(date +%s) - start)) s: $(tail -n 1 "$OUT/target.log")"

drafts=()
for loss in lk ce; do
    K3_COMPILATION_CACHE=off "$PY" -m k3_jax.training.draft --target "$WORK/target" --out "$WORK/$loss" \
        --loss "$loss" --steps "$DRAFT_STEPS" --batch-size "$DRAFT_BATCH" --seq-len "$DRAFT_SEQ" \
        --ttt-steps "$DRAFT_TTT" --max-seconds "$DRAFT_MAX_S" >"$OUT/draft_$loss.log" 2>&1 &
    drafts+=($!)
done
wait "${drafts[@]}"
for loss in lk ce; do echo "draft $loss at $(($(date +%s) - start)) s: $(grep 'draft step' "$OUT/draft_$loss.log" | tail -n 1)"; done

wait "$bench"
echo "bench: rc $? at $(($(date +%s) - start)) s"
tail -n 5 "$OUT/bench.log"
cat "$OUT/bench.jsonl"
