#!/usr/bin/env bash
# `make demo-ui`: serve the UI over the demo's database (.prefect/, SQLite) after `make demo` stopped
# the server it started, so the run URLs it printed open. Foreground; Ctrl-C stops it. No worker:
# nothing runs (--no-services: no scheduler either), the runs are only shown (`infra/prefect-up.sh` starts the full local stack).
set -euo pipefail
source "$(dirname "$0")/prefect-env.sh"
cd "$ROOT"
if [ -f "$RUN_DIR/server.pid" ] && kill -0 "$(cat "$RUN_DIR/server.pid")" 2>/dev/null; then
  echo "the local Prefect server already runs (pid $(cat "$RUN_DIR/server.pid")): http://$PREFECT_SERVER_API_HOST:$PREFECT_SERVER_API_PORT"
  exit 0
fi
umask 077  # a database this server creates is private, as infra/prefect-up.sh makes it
echo "Prefect UI over $PREFECT_HOME at http://$PREFECT_SERVER_API_HOST:$PREFECT_SERVER_API_PORT (Ctrl-C stops it)"
exec "$PREFECT" server start --host "$PREFECT_SERVER_API_HOST" --port "$PREFECT_SERVER_API_PORT" --ui --no-services
