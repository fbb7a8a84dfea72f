#!/usr/bin/env bash
# `make demo`: build the demo target once, start a local Prefect server + worker, run the `full`
# deployment with the demo profile through the server, show where the outputs are, stop what we started.
# The last line is the answer: faster or not, by how much, on which engine, and the run that measured it.
set -euo pipefail
source "$(dirname "$0")/prefect-env.sh"
cd "$ROOT"
PROFILE="${PROFILE:-profiles/demo.yaml}"

"$VENV/bin/drafter" config validate "$PROFILE"
echo "== demo target (built once, then cached)"
"$VENV/bin/drafter" demo-target --config "$PROFILE"

run_deployment drafter-lifecycle/full last-demo-run.log
echo "== outputs"
"$VENV/bin/drafter" outputs --config "$PROFILE"
ui_hint
answer_line
