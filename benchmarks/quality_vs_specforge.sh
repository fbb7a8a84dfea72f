#!/usr/bin/env bash
# Our trainer against SpecForge 0.2.0's on the same data, on one GPU, at one or more data budgets.
# The target is built once for every budget; then per budget two processes share the GPU, SpecForge
# alone in one and our variants one after the other in the other, each judged by our judge on the
# same held-out prompts; --merge pairs every variant of ours with SpecForge (paired 95% CI).
#
# The work runs DETACHED (its own session) in WORK, so it outlives one 10-minute device call: run
# the same command again in the next call (back to back, while the machine is warm) and it waits for
# the job already running instead of starting another. Each call waits at most WAIT seconds, copies
# what exists so far to OUT, and prints `state: running` or `state: done` (merged results in OUT).
#
# Needs .whl/ (specforge-0.2.0 + pydantic wheels) and .bench-data/sharegpt.jsonl.gz
# (`python3 benchmarks/bench_drafter_quality.py --write-corpus .bench-data/sharegpt.jsonl.gz`).
# Usage (on the GPU host, in the repo root; repeat the same line until it says `state: done`):
#   OUT=/some/dir CONVERSATIONS="800 4000" STEPS=3 SF_ATTENTION=sdpa bash benchmarks/quality_vs_specforge.sh
# Environment: CONVERSATIONS (budgets, space-separated, default 800), STEPS (draft steps judged, topk 1,
# default 1,3), VARIANTS (space-separated NAME=JSON train overrides, JSON without spaces; default
# 'ours={"drafter":"eagle3"}': the project's defaults with SpecForge's kind, EAGLE-3), PROMPTS (held-out prompts judged, default 32), MAX_NEW_TOKENS
# (default 96), EPOCHS (default 1), WAIT (seconds this call waits, default 560), WORK (default
# /tmp/quality-vs-specforge), SF_ATTENTION (flex_attention, SpecForge's default, or sdpa: the same
# step computed faster at batch 1, benchmarks/specforge_backends.py checks both agree).
# Writes into OUT: times.txt, target.log, and per budget N: N-merged.json (the pairing) and N.tgz
# (N-specforge.log, N-ours.log, N-merge.log and both quality.json).
set -u
OUT="${OUT:?set OUT}"
CONVERSATIONS="${CONVERSATIONS:-800}"; STEPS="${STEPS:-1,3}"; PROMPTS="${PROMPTS:-32}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-96}"; EPOCHS="${EPOCHS:-1}"; WAIT="${WAIT:-560}"
DEFAULT_VARIANTS='ours={"drafter":"eagle3"}'  # like for like: SpecForge 0.2.0 trains EAGLE-3
SF_ATTENTION="${SF_ATTENTION:-flex_attention}"; VARIANTS="${VARIANTS:-$DEFAULT_VARIANTS}"
WORK="${WORK:-/tmp/quality-vs-specforge}"
mkdir -p "$OUT" "$WORK" || exit 1

if [ ! -f "$WORK/job.pid" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
    || { echo "installing .whl/ failed"; exit 1; }
  mkdir -p "$WORK/repo" && cp -r drafter benchmarks profiles .bench-data "$WORK/repo"/ || exit 1  # its own copy: a later call may differ
  printf '%s\n' $VARIANTS > "$WORK/variants"  # one NAME=JSON per line, quotes kept
  cat > "$WORK/job.sh" <<EOF
#!/usr/bin/env bash
set -u
cd "$WORK/repo"
export PYTHONPATH="$WORK/site:$WORK/repo" PYTHONUNBUFFERED=1
B="python3 benchmarks/bench_drafter_quality.py --corpus .bench-data/sharegpt.jsonl.gz --target-dir $WORK/target
   --epochs $EPOCHS --prompts $PROMPTS --max-new-tokens $MAX_NEW_TOKENS --plain-train"
VARGS=()
while read -r v; do VARGS+=(--variant "\$v"); done < "$WORK/variants"
say() { echo "\$1 \$(date -u +%T) after \${SECONDS}s" >> "$WORK/times.txt"; }
say "start conversations=[$CONVERSATIONS] steps=$STEPS prompts=$PROMPTS variants=[\$(tr '\\n' ' ' < $WORK/variants)] specforge_attention=$SF_ATTENTION"
\$B --target-only > "$WORK/target.log" 2>&1 || { say "target build failed"; echo failed > "$WORK/state"; exit 1; }
say "target built"
PIDS=()
for n in $CONVERSATIONS; do
  \$B --work $WORK/w\$n-sf --out $WORK/\$n-specforge --conversations \$n --steps $STEPS --only-specforge \
    --specforge-attention $SF_ATTENTION > "$WORK/\$n-specforge.log" 2>&1 &
  PIDS+=("\$n:specforge:\$!")
  \$B --work $WORK/w\$n-ours --out $WORK/\$n-ours --conversations \$n --steps $STEPS "\${VARGS[@]}" \
    > "$WORK/\$n-ours.log" 2>&1 &
  PIDS+=("\$n:ours:\$!")
done
for p in "\${PIDS[@]}"; do wait "\${p##*:}"; say "\${p%:*} rc=\$?"; done
for n in $CONVERSATIONS; do
  # its own log: a failed merge says why
  if \$B --merge $WORK/\$n-specforge/quality.json $WORK/\$n-ours/quality.json --out $WORK/\$n-merged \
      > "$WORK/\$n-merge.log" 2>&1; then say "\$n merged"; else say "\$n merge failed (see \$n-merge.log)"; fi
done
say "end"
echo done > "$WORK/state"
EOF
  echo running > "$WORK/state"
  setsid nohup bash "$WORK/job.sh" > "$WORK/job.log" 2>&1 < /dev/null &
  echo $! > "$WORK/job.pid"
  echo "started the job (pid $(cat "$WORK/job.pid")) in $WORK"
else
  echo "the job started earlier (pid $(cat "$WORK/job.pid")) is still this run's: waiting for it"
fi

collect() {  # a device call brings back at most 8 files: one archive per budget
  cp "$WORK"/times.txt "$WORK"/target.log "$OUT"/ 2>/dev/null
  for n in $CONVERSATIONS; do
    cp "$WORK/$n-merged/quality-merged.json" "$OUT/$n-merged.json" 2>/dev/null
    (cd "$WORK" && tar czf "$OUT/$n.tgz" --ignore-failed-read "$n"-*.log "$n"-specforge/quality.json \
      "$n"-ours/quality.json 2>/dev/null)
  done
}
deadline=$(( SECONDS + WAIT ))
while [ "$(cat "$WORK/state")" = running ] && [ $SECONDS -lt $deadline ]; do
  if ! kill -0 "$(cat "$WORK/job.pid")" 2>/dev/null; then echo failed > "$WORK/state"; break; fi
  sleep 5
done
collect
cat "$WORK/times.txt" 2>/dev/null
echo "state: $(cat "$WORK/state")"
for n in $CONVERSATIONS; do
  grep -h "^target\|^dump\|^specforge\|^vs specforge" "$WORK/$n-specforge.log" "$WORK/$n-ours.log" 2>/dev/null | cut -c1-600
  [ -f "$WORK/$n-merged/quality-merged.json" ] && head -c 1500 "$WORK/$n-merged/quality-merged.json"
done
[ "$(cat "$WORK/state")" != failed ]
