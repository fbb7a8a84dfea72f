#!/usr/bin/env bash
# `make demo`: build the demo target once, start a local Prefect server + worker, run the `full`
# deployment with the demo profile through the server, show where the outputs are, stop what we started.
set -euo pipefail
source "$(dirname "$0")/prefect-env.sh"
cd "$ROOT"
PROFILE="${PROFILE:-profiles/demo.yaml}"

"$VENV/bin/drafter" config validate "$PROFILE"
echo "== demo target (built once, then cached)"
"$VENV/bin/drafter" demo-target --config "$PROFILE"

started_here=0
if [ ! -f "$RUN_DIR/server.pid" ]; then started_here=1; fi
cleanup() { if [ "$started_here" = 1 ]; then "$ROOT/infra/prefect-down.sh"; fi; }
trap cleanup EXIT

echo "== local Prefect server and worker"
"$ROOT/infra/prefect-up.sh"

echo "== prefect deployment run drafter-lifecycle/full --watch"
run_log="$RUN_DIR/last-demo-run.log"
"$PREFECT" deployment run drafter-lifecycle/full --param "profile=$PROFILE" --watch | tee "$run_log"
run_id=$(grep -oE 'prefect\.flow-run\.[0-9a-f-]{36}' "$run_log" | head -1 | sed 's/prefect\.flow-run\.//')

echo "== stages (from the flow run's log)"
"$PREFECT" flow-run logs "$run_id" 2>/dev/null | grep -oE 'stage [a-z]+(:| \|) .*' || echo "(see the Prefect UI for run $run_id)"
echo "== outputs"
"$VENV/bin/drafter" outputs --config "$PROFILE"
