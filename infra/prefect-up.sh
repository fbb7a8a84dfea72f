#!/usr/bin/env bash
# Start a local Prefect server (SQLite under .prefect/) and a process worker, then deploy.
# Each runs in its own session with a pid file so infra/prefect-down.sh stops the whole group.
set -euo pipefail
source "$(dirname "$0")/prefect-env.sh"
cd "$ROOT"
# What this script creates under the Prefect home (the database, logs, the workers' TMPDIR) is the
# owner's only; the workers themselves run with the caller's umask (their flow runs write the outputs).
CALLER_UMASK=$(umask)
umask 077

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if alive "$RUN_DIR/server.pid"; then
  echo "prefect server already running (pid $(cat "$RUN_DIR/server.pid"))"
else
  if (exec 3<>"/dev/tcp/$PREFECT_SERVER_API_HOST/$PREFECT_SERVER_API_PORT") 2>/dev/null; then
    echo "port $PREFECT_SERVER_API_PORT is taken by another process; set PREFECT_SERVER_API_PORT" >&2
    exit 1
  fi
  setsid "$PREFECT" server start --host "$PREFECT_SERVER_API_HOST" --port "$PREFECT_SERVER_API_PORT" \
    >"$RUN_DIR/server.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/server.pid"
  echo "prefect server starting (log: $RUN_DIR/server.log)"
fi

# Wait while the server process lives, up to DRAFTER_PREFECT_START_TIMEOUT_S (default 600 s: a loaded
# 2-core machine takes minutes, not the seconds an idle one does); a server that exits ends the wait.
started=$SECONDS
while [ $((SECONDS - started)) -lt "${DRAFTER_PREFECT_START_TIMEOUT_S:-600}" ]; do
  if "$VENV/bin/python" -c "import httpx,sys; sys.exit(httpx.get('$PREFECT_API_URL/health', timeout=5).status_code != 200)" 2>/dev/null; then
    break
  fi
  alive "$RUN_DIR/server.pid" || { echo "prefect server exited:" >&2; tail -20 "$RUN_DIR/server.log" >&2; exit 1; }
  sleep 1
done
"$VENV/bin/python" -c "import httpx,sys; sys.exit(httpx.get('$PREFECT_API_URL/health', timeout=2).status_code != 200)" \
  || { echo "prefect server did not become healthy; see $RUN_DIR/server.log" >&2; exit 1; }
echo "prefect server ready at $PREFECT_API_URL"

"$PREFECT" work-pool inspect "$POOL" >/dev/null 2>&1 || "$PREFECT" work-pool create "$POOL" --type process >/dev/null
# The UI's pool page suggests `prefect worker start --pool "$POOL"` (fixed in Prefect's UI): the pool's
# description says how this project starts its worker, and that the suggestion works too.
"$VENV/bin/python" - "$POOL" <<'PY'
import sys
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolUpdate
pool = sys.argv[1]
with get_client(sync_client=True) as client:
    client.update_work_pool(pool, WorkPoolUpdate(description=(
        f"Process pool of this checkout. infra/prefect-up.sh starts its worker: `python infra/worker.py {pool}`, "
        "the same ProcessWorker as `prefect worker start`, which also stops on SIGTERM (infra/prefect-down.sh). "
        f"The command below works as well, in a shell that ran `source infra/prefect-env.sh`.")))
PY
echo "work pool $POOL ready (process)"

# DRAFTER_WORKERS=N starts N process workers on the pool (a fan-out's children run side by side):
# worker.pid / worker.log, then worker-2.pid / worker-2.log, ...
for i in $(seq 1 "${DRAFTER_WORKERS:-1}"); do
  name=worker; [ "$i" = 1 ] || name="worker-$i"
  if alive "$RUN_DIR/$name.pid"; then
    echo "$name already running (pid $(cat "$RUN_DIR/$name.pid"))"
  else
    mkdir -p "$WORKER_TMP"
    : >"$RUN_DIR/$name.log"  # 0600 (umask 077), kept when the worker's redirection truncates it
    (umask "$CALLER_UMASK" && TMPDIR="$WORKER_TMP" exec setsid "$VENV/bin/python" "$ROOT/infra/worker.py" "$POOL" "$name" \
      >"$RUN_DIR/$name.log" 2>&1 < /dev/null) &
    echo $! > "$RUN_DIR/$name.pid"
    echo "$name started (log: $RUN_DIR/$name.log)"
  fi
done

"$PREFECT" --no-prompt deploy --all --prefect-file deployments/prefect.yaml >"$RUN_DIR/deploy.log" 2>&1 \
  || { cat "$RUN_DIR/deploy.log" >&2; exit 1; }
echo "deployments registered: $("$PREFECT" deployment ls 2>/dev/null | grep -c drafter-lifecycle || true) (log: $RUN_DIR/deploy.log)"
