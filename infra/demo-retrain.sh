#!/usr/bin/env bash
# `make demo-retrain`: append a batch of new prompts to the growing demo source (the first call
# writes the base corpus), then run the retrain-nightly deployment through the local Prefect server:
# only the new conversations are generated and dumped, the champion is fine-tuned, benched side by
# side with the challenger, and the challenger is promoted only when it is measurably better.
set -euo pipefail
source "$(dirname "$0")/prefect-env.sh"
cd "$ROOT"
PROFILE="${PROFILE:-profiles/retrain-demo.yaml}"
SOURCE="${SOURCE:-runs/demo-source}"

echo "== a new batch of prompts"
"$VENV/bin/drafter" demo-source --dir "$SOURCE" --first "${FIRST:-300}" --batch "${BATCH:-30}"
"$VENV/bin/drafter" config validate "$PROFILE"
"$VENV/bin/drafter" demo-target --config "$PROFILE"

run_deployment drafter-retrain/retrain-nightly last-retrain-run.log
echo "== the registry"
"$VENV/bin/drafter" registry list --config "$PROFILE"
ui_hint
