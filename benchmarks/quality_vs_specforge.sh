#!/usr/bin/env bash
# Our trainer against SpecForge 0.2.0's on the same data, on one GPU, one budget per call: the
# target is built once (found again if already built), then two processes share the GPU:
# SpecForge alone in one, our variants one after the other in the other, each judged by our judge
# on the same held-out prompts; --merge pairs every variant of ours with SpecForge (paired 95% CI).
# Needs .whl/ (specforge-0.2.0 + pydantic wheels) and .bench-data/sharegpt.jsonl.gz
# (`python3 benchmarks/bench_drafter_quality.py --write-corpus .bench-data/sharegpt.jsonl.gz`).
# Usage (on the GPU host, in the repo root):
#   OUT=/some/dir CONVERSATIONS=4000 STEPS=3 bash benchmarks/quality_vs_specforge.sh
#   OUT=/some/dir CONVERSATIONS=800 STEPS=1,3 \
#     VARIANTS='ours={} b1024={"tokens_per_micro_batch":1024} ours_2ep={"epochs":2}' bash benchmarks/quality_vs_specforge.sh
# Environment: CONVERSATIONS (budget, default 800), STEPS (draft steps judged, topk 1, default 1,3),
# VARIANTS (space-separated NAME=JSON train overrides, JSON without spaces; default
# 'ours={} b1024={"tokens_per_micro_batch":1024}'), PROMPTS (held-out prompts judged, default 32),
# MAX_NEW_TOKENS (default 96), EPOCHS (default 1), DEADLINE (seconds after this script starts at
# which both trainer processes are stopped, default 578, so the whole call ends inside 10 minutes),
# SF_ATTENTION (SpecForge's attention backend: flex_attention, its default, or sdpa, the same step
# computed faster at batch 1; benchmarks/specforge_backends.py checks both agree; default flex_attention),
# CHECK_BACKENDS=1 (also run that check, in the background from the start, into OUT/specforge-backends.json).
# Writes into OUT: target.log, specforge.log, ours.log (as they run), specforge/quality.json,
# ours/quality.json, merged/quality-merged.json, times.txt.
set -u
OUT="${OUT:?set OUT}"
CONVERSATIONS="${CONVERSATIONS:-800}"; STEPS="${STEPS:-1,3}"; PROMPTS="${PROMPTS:-32}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-96}"; EPOCHS="${EPOCHS:-1}"; DEADLINE="${DEADLINE:-578}"
SF_ATTENTION="${SF_ATTENTION:-flex_attention}"; CHECK_BACKENDS="${CHECK_BACKENDS:-0}"
VARIANTS="${VARIANTS:-ours={\} b1024={\"tokens_per_micro_batch\":1024\}}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
B="python3 benchmarks/bench_drafter_quality.py --corpus .bench-data/sharegpt.jsonl.gz --target-dir /tmp/target
   --epochs $EPOCHS --prompts $PROMPTS --max-new-tokens $MAX_NEW_TOKENS --plain-train"
VARGS=()
for v in $VARIANTS; do VARGS+=(--variant "$v"); done
W=/tmp/quality-$CONVERSATIONS
mkdir -p "$OUT"/specforge "$OUT"/ours "$OUT"/merged
echo "start $(date -u +%T) conversations=$CONVERSATIONS steps=$STEPS prompts=$PROMPTS variants=$VARIANTS specforge_attention=$SF_ATTENTION" > "$OUT"/times.txt
if [ "$CHECK_BACKENDS" = 1 ]; then
  python3 benchmarks/specforge_backends.py --steps 60 --out "$OUT"/specforge-backends.json > "$OUT"/specforge-backends.log 2>&1 &
  CHECK=$!
fi
$B --target-only > "$OUT"/target.log 2>&1 || { echo "target build failed"; tail -n 40 "$OUT"/target.log; exit 1; }
LIMIT=$(( DEADLINE - SECONDS ))
echo "target done $(date -u +%T) after ${SECONDS}s; trainer processes get ${LIMIT}s" >> "$OUT"/times.txt
timeout -k 5 "$LIMIT" $B --work $W-sf --out "$OUT"/specforge --conversations "$CONVERSATIONS" --steps "$STEPS" \
  --only-specforge --specforge-attention "$SF_ATTENTION" > "$OUT"/specforge.log 2>&1 &
SF=$!
timeout -k 5 "$LIMIT" $B --work $W-ours --out "$OUT"/ours --conversations "$CONVERSATIONS" --steps "$STEPS" \
  "${VARGS[@]}" > "$OUT"/ours.log 2>&1 &
OURS=$!
wait $OURS; echo "ours rc=$? at ${SECONDS}s" >> "$OUT"/times.txt
wait $SF; echo "specforge rc=$? at ${SECONDS}s" >> "$OUT"/times.txt
[ "$CHECK_BACKENDS" = 1 ] && { wait $CHECK; echo "backend check rc=$? at ${SECONDS}s" >> "$OUT"/times.txt; }
$B --merge "$OUT"/specforge/quality.json "$OUT"/ours/quality.json --out "$OUT"/merged > /dev/null 2>&1 \
  || echo "merge failed (a process did not finish?)" >> "$OUT"/times.txt
echo "end $(date -u +%T) after ${SECONDS}s" >> "$OUT"/times.txt
cat "$OUT"/times.txt
NAMES=$(for v in $VARIANTS; do printf '\\|^%s ' "${v%%=*}"; done)
grep -h "^target\|^dump\|^specforge\|^vs specforge$NAMES" "$OUT"/specforge.log "$OUT"/ours.log | cut -c1-700
