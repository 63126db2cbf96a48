#!/usr/bin/env bash
# Stop the one-node Slurm test cluster started by setup-test-cluster.sh.
#
#   stop-test-cluster.sh [--purge] [--keep-munge]
#
#   --purge       first SIGKILL all jobs, then wipe slurmctld/slurmd state
#                 (next setup starts with an empty queue, job ids from 1)
#   --keep-munge  leave munged running
#
# Without --purge, running jobs' slurmstepd processes survive (as in any Slurm
# daemon restart) and the queue is recovered on the next start.
# Idempotent: does nothing for daemons that are not running.
set -euo pipefail

PURGE=0
KEEP_MUNGE=0
for arg in "$@"; do
    case "$arg" in
        --purge) PURGE=1 ;;
        --keep-munge) KEEP_MUNGE=1 ;;
        -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done

CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_PID=/run/munge/munged.pid

log() { echo "stop-test-cluster: $*" >&2; }

[[ $(id -u) -eq 0 ]] || { log "ERROR: must run as root"; exit 1; }

pid_of() { # <pidfile> <comm>: print the pid if it is a live <comm>
    local pid
    [[ -r $1 ]] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ && $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1
    echo "$pid"
}

# stop_pid <pidfile> <comm>: SIGTERM, wait up to 15 s, then SIGKILL.
stop_pid() {
    local pid i
    pid=$(pid_of "$1" "$2") || return 0
    log "stopping $2 (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 30; i++)); do
        [[ -e /proc/$pid ]] || { rm -f "$1"; return 0; }
        sleep 0.5
    done
    log "$2 did not exit; SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$1"
}

ctld_up() { pid_of "$CTLD_PID" slurmctld >/dev/null; }

if [[ $PURGE == 1 ]] && ctld_up; then
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
    if [[ -n $jobs ]]; then
        log "killing all jobs"
        # shellcheck disable=SC2086
        timeout 10 scancel --full --signal=KILL $jobs 2>/dev/null || true
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs 2>/dev/null || true
        for ((i = 0; i < 30; i++)); do
            [[ -z $(timeout 10 squeue -h -o %i 2>/dev/null || true) ]] && break
            sleep 1
        done
    fi
fi

if ctld_up; then
    # Stops slurmctld and the slurmd it knows about.
    timeout 10 scontrol shutdown >/dev/null 2>&1 || true
    for ((i = 0; i < 20; i++)); do
        pid_of "$CTLD_PID" slurmctld >/dev/null || pid_of "$SLURMD_PID" slurmd >/dev/null || break
        sleep 0.5
    done
fi
stop_pid "$SLURMD_PID" slurmd
stop_pid "$CTLD_PID" slurmctld

if [[ $PURGE == 1 ]]; then
    for ((i = 0; i < 20; i++)); do
        pgrep -x slurmstepd >/dev/null 2>&1 || break
        sleep 0.5
    done
    if pgrep -x slurmstepd >/dev/null 2>&1; then
        log "WARNING: slurmstepd processes still running (jobs did not die)"
    fi
    log "wiping /var/spool/slurmctld and /var/spool/slurmd"
    rm -rf /var/spool/slurmctld/* /var/spool/slurmd/*
fi

if [[ $KEEP_MUNGE == 0 ]]; then
    stop_pid "$MUNGE_PID" munged
fi
log "stopped"
