#!/usr/bin/env bash
# Stop what infra/prefect-up.sh started: SIGTERM each process group, wait, SIGKILL, check none is left.
set -uo pipefail
source "$(dirname "$0")/prefect-env.sh"

stop_group() {
  local name=$1 pidfile="$RUN_DIR/$1.pid"
  [ -f "$pidfile" ] || return 0
  local pid; pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 -- "-$pid" 2>/dev/null; then
      echo "$name did not stop within 15 s; sending SIGKILL" >&2
      kill -KILL -- "-$pid" 2>/dev/null
      sleep 0.5
    fi
  fi
  if kill -0 -- "-$pid" 2>/dev/null; then
    echo "$name: processes of group $pid are still alive" >&2
    return 1
  fi
  rm -f "$pidfile"
  echo "$name stopped"
}

rc=0
stop_group worker || rc=1
stop_group server || rc=1
exit $rc
