#!/usr/bin/env bash
# Stop what infra/prefect-up.sh started: SIGTERM each process group, wait, SIGKILL, check none is left.
# The workers go first; while the server still runs, their records leave the pool (else the UI keeps
# showing a stopped worker Online: its status is only recomputed by the server's services, which a
# UI-only server over the same database, `make demo-ui`, does not run) and the pool's status is
# recomputed (Not Ready once no worker is online). Last, the workers' TMPDIR is removed: Prefect's
# process worker writes each flow run's environment there and leaves it when the worker dies.
set -uo pipefail
source "$(dirname "$0")/prefect-env.sh"

# Live (non-zombie) members of a process group: a zombie is already dead, only unreaped.
group_alive() { ps -eo pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {found=1} END {exit !found}'; }

stop_group() {
  local name=$1 pidfile="$RUN_DIR/$1.pid"
  [ -f "$pidfile" ] || return 0
  local pid; pid=$(cat "$pidfile")
  if group_alive "$pid"; then
    kill -TERM -- "-$pid" 2>/dev/null
    for _ in $(seq 1 60); do group_alive "$pid" || break; sleep 0.5; done
    if group_alive "$pid"; then
      echo "$name did not stop within 30 s; sending SIGKILL" >&2
      kill -KILL -- "-$pid" 2>/dev/null
      for _ in $(seq 1 20); do group_alive "$pid" || break; sleep 0.25; done
    fi
  fi
  if group_alive "$pid"; then
    echo "$name: processes of group $pid are still alive" >&2
    return 1
  fi
  rm -f "$pidfile"
  echo "$name stopped"
}

# Processes that still have $1 as their TMPDIR (a flow run that outlived a killed worker, a server in
# its teardown grace): their pids, none where /proc cannot tell.
tmp_users() {
  [ -d /proc ] || return 0
  grep -lsxzF "TMPDIR=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | tr '\n' ' '
}

rc=0
stopped=()
for pidfile in "$RUN_DIR"/worker*.pid; do
  [ -e "$pidfile" ] || continue
  name=$(basename "$pidfile" .pid)
  if stop_group "$name"; then stopped+=("$name"); else rc=1; fi
done
if [ "${#stopped[@]}" -gt 0 ] && [ -f "$RUN_DIR/server.pid" ] && group_alive "$(cat "$RUN_DIR/server.pid")"; then
  "$VENV/bin/python" "$ROOT/infra/worker.py" --forget "$POOL" "${stopped[@]}" || rc=1
fi
stop_group server || rc=1
if [ -d "$WORKER_TMP" ]; then
  users=$(tmp_users "$WORKER_TMP")
  if [ -n "$users" ]; then
    echo "kept $WORKER_TMP: still the TMPDIR of process(es) $users" >&2
    rc=1
  else
    rm -rf "$WORKER_TMP" && echo "removed the workers' TMPDIR $WORKER_TMP"
  fi
fi
exit $rc
