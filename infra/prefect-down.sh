#!/usr/bin/env bash
# Stop what infra/prefect-up.sh started: SIGTERM each process group, wait, SIGKILL, check none is left.
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

rc=0
for pidfile in "$RUN_DIR"/worker*.pid; do
  [ -e "$pidfile" ] || continue
  stop_group "$(basename "$pidfile" .pid)" || rc=1
done
stop_group server || rc=1
exit $rc
