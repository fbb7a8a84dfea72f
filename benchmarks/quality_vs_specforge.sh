#!/usr/bin/env bash
# Our trainer against SpecForge 0.2.0's on the same data, on one GPU, in one call: the target is
# built once, then four processes share the GPU: SpecForge and ours at a small budget (800
# conversations) and at a 5x one (4000), each judged by our judge; --merge pairs them per budget.
# Needs .whl/ (specforge-0.2.0 + pydantic wheels) and .bench-data/sharegpt.jsonl.gz
# (`python3 benchmarks/bench_drafter_quality.py --write-corpus .bench-data/sharegpt.jsonl.gz`).
# Usage (on the GPU host): OUT=/some/dir bash benchmarks/quality_vs_specforge.sh
set -u
OUT="${OUT:?set OUT}"; LIMIT="${LIMIT:-420}"   # seconds per process after the target build
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
B="python3 benchmarks/bench_drafter_quality.py --corpus .bench-data/sharegpt.jsonl.gz --target-dir /tmp/target --epochs 1 --prompts 16 --max-new-tokens 96 --plain-train"
mkdir -p "$OUT"/a1 "$OUT"/a2 "$OUT"/b1 "$OUT"/b2 /tmp/logs
$B --target-only > /tmp/logs/t.txt 2>&1
timeout "$LIMIT" $B --work /tmp/a1 --out "$OUT"/a1 --conversations 800 --steps 1,3 --only-specforge > /tmp/logs/a1.txt 2>&1 &
timeout "$LIMIT" $B --work /tmp/a2 --out "$OUT"/a2 --conversations 800 --steps 1,3 --variant 'lr6e-4={"learning_rate":6e-4}' \
  --variant 'lr6e-4_2ep={"learning_rate":6e-4,"epochs":2}' > /tmp/logs/a2.txt 2>&1 &
timeout "$LIMIT" $B --work /tmp/b1 --out "$OUT"/b1 --conversations 4000 --steps 3 --only-specforge > /tmp/logs/b1.txt 2>&1 &
timeout "$LIMIT" $B --work /tmp/b2 --out "$OUT"/b2 --conversations 4000 --steps 3 --variant 'lr6e-4={"learning_rate":6e-4}' \
  --variant 'lr1e-3={"learning_rate":1e-3}' > /tmp/logs/b2.txt 2>&1 &
wait
$B --merge "$OUT"/a1/quality.json "$OUT"/a2/quality.json --out "$OUT"/a > /dev/null 2>&1
$B --merge "$OUT"/b1/quality.json "$OUT"/b2/quality.json --out "$OUT"/b > /dev/null 2>&1
for f in /tmp/logs/*.txt; do echo "== $f"; grep -v -i 'warn\|Loading weights\|Writing model\|^ *$' "$f" | tail -n 25 | cut -c1-400; done > "$OUT"/logs.txt
tail -n 60 "$OUT"/logs.txt
