#!/usr/bin/env bash
# Refuse, with the reason, before a venv install that would fill the disk half way through
# (pip's "No space left on device" leaves a broken venv behind and names no remedy).
# Usage: infra/need-disk.sh GIB WHAT
set -euo pipefail
need_gib=$1
what=$2
free_kib=$(df -Pk . | awk 'NR==2 {print $4}')
free_gib=$((free_kib / 1024 / 1024))
if [ "$free_gib" -lt "$need_gib" ]; then
  echo "error: $what needs about $need_gib GiB free here; $(pwd) has $free_gib GiB. Free some space and run make again." >&2
  exit 1
fi
