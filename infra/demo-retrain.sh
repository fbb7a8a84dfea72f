#!/usr/bin/env bash
# `make demo-retrain`: append a batch of new prompts to the growing demo source (the first call
# writes the base corpus), then run the retrain-nightly deployment through the local Prefect server:
# only the new conversations are generated and dumped, the champion is fine-tuned, and the
# challenger is promoted only when it is measurably better.
set -euo pipefail
source "$(dirname "$0")/prefect-env.sh"
cd "$ROOT"
PROFILE="${PROFILE:-profiles/retrain-demo.yaml}"
SOURCE="${SOURCE:-runs/demo-source}"

echo "== a new batch of prompts"
"$VENV/bin/drafter" demo-source --dir "$SOURCE" --first "${FIRST:-300}" --batch "${BATCH:-30}"
"$VENV/bin/drafter" config validate "$PROFILE"
"$VENV/bin/drafter" demo-target --config "$PROFILE"

started_here=0
if [ ! -f "$RUN_DIR/server.pid" ]; then started_here=1; fi
cleanup() { if [ "$started_here" = 1 ]; then "$ROOT/infra/prefect-down.sh"; fi; }
trap cleanup EXIT
echo "== local Prefect server and worker"
"$ROOT/infra/prefect-up.sh"

echo "== prefect deployment run drafter-retrain/retrain-nightly --watch"
run_log="$RUN_DIR/last-retrain-run.log"
"$PREFECT" deployment run drafter-retrain/retrain-nightly --param "profile=$PROFILE" --watch | tee "$run_log"
run_id=$(grep -oE 'prefect\.flow-run\.[0-9a-f-]{36}' "$run_log" | head -1 | sed 's/prefect\.flow-run\.//')
echo "== stages (from the flow run's log)"
"$PREFECT" flow-run logs "$run_id" 2>/dev/null | grep -oE 'stage [a-z]+(:| \|) .*' || echo "(see the Prefect UI for run $run_id)"
echo "== the registry"
"$VENV/bin/drafter" registry list --config "$PROFILE"
