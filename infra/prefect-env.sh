# Sourced by the infra scripts: one local Prefect server per checkout, state under .prefect/.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export DRAFTER_PROJECT_DIR="$ROOT"
export PREFECT_HOME="${PREFECT_HOME:-$ROOT/.prefect}"
export PREFECT_SERVER_API_HOST="${PREFECT_SERVER_API_HOST:-127.0.0.1}"
export PREFECT_SERVER_API_PORT="${PREFECT_SERVER_API_PORT:-4200}"
export PREFECT_API_URL="http://${PREFECT_SERVER_API_HOST}:${PREFECT_SERVER_API_PORT}/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_UI_ENABLED="${PREFECT_UI_ENABLED:-true}"
# The server streams run logs out (off by default in 3.9), so `prefect deployment run --watch`
# shows the run's log lines, among them a failed stage's reason, not only its state events.
export PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED=true PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED=true
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
VENV="${VENV:-$ROOT/.venv}"
PREFECT="$VENV/bin/prefect"
RUN_DIR="$PREFECT_HOME/run"
# The workers' TMPDIR (infra/prefect-up.sh): Prefect's process worker writes each flow run's whole
# environment there (prefect-workspace-attempt-*/workspace.json, a `serve.secrets: env:` value
# included), left behind when a worker dies; infra/prefect-down.sh removes it.
WORKER_TMP="$RUN_DIR/tmp"
POOL="${DRAFTER_WORK_POOL:-drafter-local}"
# The Prefect home holds the database (every run's parameters, states and logs) and the server's and
# workers' logs: private to its owner (0700; prefect-up.sh starts the server with umask 077, so the
# database and logs are 0600). A home of an older checkout is tightened the same way.
(umask 077 && mkdir -p "$RUN_DIR")
chmod 700 "$PREFECT_HOME" "$RUN_DIR"
for f in "$PREFECT_HOME"/prefect.db* "$RUN_DIR"/*.log; do [ ! -f "$f" ] || chmod 600 "$f"; done
# A flow run's own environment (the drafter logger in the run log, HF offline) is the deployments'
# job_variables (deployments/prefect.yaml), so any process worker on the pool runs it the same way.

# The demo scripts' common part: start the local server + worker unless one runs (stopped again when
# the calling script exits, if we started it), run deployment $1 with $PROFILE, watch it, and print
# the stage lines of its log. $2: the log file's name under $RUN_DIR. When the run fails: the failed
# stage's one-line reason (the run's state message), where to look, then exit with --watch's code.
run_deployment() {
  local deployment="$1" run_log="$RUN_DIR/$2" run_id run_lines rc=0
  started_here=0
  if [ ! -f "$RUN_DIR/server.pid" ]; then started_here=1; fi
  trap 'if [ "$started_here" = 1 ]; then "$ROOT/infra/prefect-down.sh"; fi' EXIT
  echo "== local Prefect server and worker"
  "$ROOT/infra/prefect-up.sh"
  echo "== prefect deployment run $deployment --watch"
  # whole lines (not wrapped at 80 columns when piped), so the log keeps each reason on one line
  # The run's final state decides below (infra/run_state.py), not this pipe's exit status.
  (umask 077 && : >"$run_log")  # private like the other logs under the Prefect home (tee keeps the mode)
  PREFECT_CLI_WRAP_LINES=false "$PREFECT" deployment run "$deployment" --param "profile=$PROFILE" --watch \
    | tee "$run_log" || true
  run_id=$(grep -oE 'UUID: [0-9a-f-]{36}' "$run_log" | head -1 | sed 's/^UUID: //')
  RUN_URL=$(grep -oE 'URL: http[^ ]+' "$run_log" | head -1 | sed 's/^URL: //')
  [ -n "$run_id" ] || { echo "no flow run was created (see above)" >&2; exit 1; }
  echo "== stages (from the flow run's log)"
  run_lines=$("$PREFECT" flow-run logs "$run_id" 2>/dev/null || true)
  grep -oE 'stage [a-z]+(:| \|) .*' <<<"$run_lines" || echo "(see the Prefect UI for run $run_id)"
  # the run's answer (the bench's: faster or not, by how much, on which engine, and the run that
  # measured it), the last line the demo prints (answer_line)
  ANSWER=$(grep -oE 'answer: .*' <<<"$run_lines" | tail -1 || true)
  "$VENV/bin/python" "$ROOT/infra/run_state.py" "$run_id" || rc=$?
  if [ "$rc" != 0 ]; then
    echo "logs: $RUN_DIR/worker.log (the worker and its flow runs), $run_log (this watch)"
    ui_hint
    exit "$rc"
  fi
}

# The run's answer (run_deployment read it from the run's log): the demo's last line.
answer_line() {
  [ -z "${ANSWER:-}" ] || echo "$ANSWER"
}

# Where the run is in the UI, and how to open it once the demo has stopped the server it started.
ui_hint() {
  [ -n "${RUN_URL:-}" ] || return 0
  if [ "${started_here:-0}" = 1 ]; then
    echo "run: $RUN_URL (the demo stops the server it started: \`make demo-ui\` serves .prefect/ again so it opens)"
  else
    echo "run: $RUN_URL"
  fi
}
