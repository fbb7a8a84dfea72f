# Sourced by the infra scripts: one local Prefect server per checkout, state under .prefect/.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export DRAFTER_PROJECT_DIR="$ROOT"
export PREFECT_HOME="${PREFECT_HOME:-$ROOT/.prefect}"
export PREFECT_SERVER_API_HOST="${PREFECT_SERVER_API_HOST:-127.0.0.1}"
export PREFECT_SERVER_API_PORT="${PREFECT_SERVER_API_PORT:-4200}"
export PREFECT_API_URL="http://${PREFECT_SERVER_API_HOST}:${PREFECT_SERVER_API_PORT}/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_UI_ENABLED="${PREFECT_UI_ENABLED:-true}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
VENV="${VENV:-$ROOT/.venv}"
PREFECT="$VENV/bin/prefect"
RUN_DIR="$PREFECT_HOME/run"
POOL="${DRAFTER_WORK_POOL:-drafter-local}"
mkdir -p "$RUN_DIR"
export PREFECT_LOGGING_EXTRA_LOGGERS="${PREFECT_LOGGING_EXTRA_LOGGERS:-drafter}"  # library warnings (storage retries, reaped servers) in the run log

# The demo scripts' common part: start the local server + worker unless one runs (stopped again when
# the calling script exits, if we started it), run deployment $1 with $PROFILE, watch it, and print
# the stage lines of its log. $2: the log file's name under $RUN_DIR.
run_deployment() {
  local deployment="$1" run_log="$RUN_DIR/$2" run_id
  started_here=0
  if [ ! -f "$RUN_DIR/server.pid" ]; then started_here=1; fi
  trap 'if [ "$started_here" = 1 ]; then "$ROOT/infra/prefect-down.sh"; fi' EXIT
  echo "== local Prefect server and worker"
  "$ROOT/infra/prefect-up.sh"
  echo "== prefect deployment run $deployment --watch"
  "$PREFECT" deployment run "$deployment" --param "profile=$PROFILE" --watch | tee "$run_log"
  run_id=$(grep -oE 'prefect\.flow-run\.[0-9a-f-]{36}' "$run_log" | head -1 | sed 's/prefect\.flow-run\.//')
  echo "== stages (from the flow run's log)"
  "$PREFECT" flow-run logs "$run_id" 2>/dev/null | grep -oE 'stage [a-z]+(:| \|) .*' || echo "(see the Prefect UI for run $run_id)"
}
