#!/usr/bin/env bash
# Stop the daemons started by slurm/local-cluster.sh (running jobs are killed with them).
# Pass --munge to stop munged too.
set -uo pipefail
RUNDIR=/run/slurm
for name in slurmd slurmctld; do
  pf=$RUNDIR/$name.pid
  if [ -f "$pf" ] && kill -0 "$(cat "$pf")" 2>/dev/null; then
    pid=$(cat "$pf"); kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    echo "[local-cluster] stopped $name ($pid)" >&2
  fi
done
if [ "${1:-}" = "--munge" ] && [ -f /run/munge/munged.pid ]; then
  kill "$(cat /run/munge/munged.pid)" 2>/dev/null && echo "[local-cluster] stopped munged" >&2
fi
exit 0
