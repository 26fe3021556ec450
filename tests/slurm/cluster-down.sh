#!/usr/bin/env bash
# cluster-down.sh — stop the test cluster started by cluster-up.sh: cancel its jobs, then stop its
# daemons by their PID files (never by name). munged is stopped only if cluster-up.sh started it.
ROOT=${LLMFT_SLURM_ROOT:-/var/lib/llmft-slurm}
log() { echo "[cluster-down $(date +%T)] $*"; }

alive() {
  local f=$1 p
  [ -s "$f" ] || return 1
  p=$(cat "$f")
  kill -0 "$p" 2>/dev/null && grep -qE '^(slurmctld|slurmd|munged)$' "/proc/$p/comm" 2>/dev/null
}
stop() {
  local f=$1 p
  alive "$f" || return 0
  p=$(cat "$f")
  kill "$p"
  for _ in $(seq 1 80); do kill -0 "$p" 2>/dev/null || return 0; sleep 0.25; done
  kill -9 "$p" 2>/dev/null
}

# Jobs outlive slurmd (their slurmstepd keeps running): cancel them while the controller still answers.
if alive "$ROOT/run/slurmctld.pid"; then
  jobs=$(squeue -h -t PENDING,RUNNING,COMPLETING,SUSPENDED -o %A 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    log "cancelling jobs: $jobs"
    scancel $jobs 2>/dev/null
    for _ in $(seq 1 60); do
      [ -z "$(squeue -h -t PENDING,RUNNING,COMPLETING,SUSPENDED -o %A 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
fi
for f in "$ROOT"/run/slurmd-*.pid; do stop "$f"; done
stop "$ROOT/run/slurmctld.pid"
stop "$ROOT/run/munged.pid"
rm -f "$ROOT/run/munged.pid"
log "stopped"
exit 0
