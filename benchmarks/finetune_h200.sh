#!/usr/bin/env bash
# Issue 24's H200 measurements in one device call (the device machine keeps no files between calls):
#   * fine-tuning quality (benchmarks/finetune_quality.py): k3-small pre-trained on the bundled corpus, then full /
#     QAT / LoRA fine-tunes on its held-out slice; curves.json rewritten as the runs progress;
#   * fine-tuning cost (benchmarks/finetune.py): LoRA over frozen MXFP4 experts against full fine-tuning.
# Every process compiles at once from shapes and they take turns on the accelerator (one K3_BENCH_LOCK), so the
# GPU is busy from the first finished compile on. Both scripts get TERM at TOTAL_S (their own process only:
# `--foreground`, so their handlers stop the children) and write what they have.
#
#   OUT=/tmp/ft VARIANTS= bash benchmarks/finetune_h200.sh       # H200: the quality run alone (VARIANTS empty)
#   OUT=/tmp/ft bash benchmarks/finetune_h200.sh                 # H200: both; the seven compiles share the host's
#                                                                # cores, so the quality run may not finish in TOTAL_S
#                                                                # (benchmarks/ARCHIVE.md has the calls' timings)
#   Q_CONFIG=configs/k3-tiny.json Q_BATCH=2 Q_SEQ=64 PRETRAIN_STEPS=4 FINETUNE_STEPS=2 EVAL_EVERY=1 \
#       B_CONFIG=configs/k3-tiny.json B_BATCH=2 B_SEQ=64 B_STEPS=1 bash benchmarks/finetune_h200.sh   # CPU smoke
#
# Output in $OUT: curves.json (the quality curves), quality.jsonl (per-run lines, then the summary line),
# quality.log, bench.jsonl (one line per variant, then the summary), bench.log.
set -u
cd "$(dirname "$0")/.."
: "${PY:=python3}" "${OUT:=/tmp/ft_out}" "${WORK:=/tmp/ft_work}" "${TOTAL_S:=300}"
: "${Q_CONFIG:=configs/k3-small.json}" "${Q_BATCH:=16}" "${Q_SEQ:=512}"
: "${PRETRAIN_STEPS:=150}" "${FINETUNE_STEPS:=60}" "${EVAL_EVERY:=10}"
: "${B_CONFIG:=configs/k3-slice.json}" "${B_BATCH:=8}" "${B_SEQ:=1024}" "${B_STEPS:=3}"
: "${VARIANTS=full,lora16_mxfp4,lora64_mxfp4}"  # unset: these; empty: no cost run
export K3_BENCH_LOCK="$WORK/accelerator.lock" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK" && touch "$K3_BENCH_LOCK"
start=$(date +%s)

bench=
if [ -n "$VARIANTS" ]; then  # VARIANTS= (empty): the quality run alone
    timeout --foreground -s TERM -k 10 "$TOTAL_S" "$PY" benchmarks/finetune.py --config "$B_CONFIG" \
        --batch-size "$B_BATCH" --seq-len "$B_SEQ" --steps "$B_STEPS" --variants "$VARIANTS" \
        >"$OUT/bench.jsonl" 2>"$OUT/bench.log" &
    bench=$!
fi
timeout --foreground -s TERM -k 10 "$TOTAL_S" "$PY" benchmarks/finetune_quality.py --config "$Q_CONFIG" --out "$WORK/ftq" \
    --curves "$OUT/curves.json" --batch-size "$Q_BATCH" --seq-len "$Q_SEQ" --pretrain-steps "$PRETRAIN_STEPS" \
    --finetune-steps "$FINETUNE_STEPS" --eval-every "$EVAL_EVERY" >"$OUT/quality.jsonl" 2>"$OUT/quality.log"
echo "quality: rc $? at $(($(date +%s) - start)) s"
if [ -n "$bench" ]; then
    wait "$bench"
    echo "bench: rc $? at $(($(date +%s) - start)) s"
    tail -n 3 "$OUT/bench.log"
    cat "$OUT/bench.jsonl"
fi
tail -n 3 "$OUT/quality.log"
cat "$OUT/quality.jsonl"
