#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/path/to/prolog.sh) for memsnap.
#
# Makes sure memsnapd answers on this node before a job starts: a health check through
# `memsnapctl status` (the typed gRPC client, with a deadline); if it does not answer and the
# node runs systemd, `systemctl start memsnapd` once and check again.
#
# It never fails the node: a job whose memsnapd is down still runs (the launcher runs the
# workload directly, without checkpoints), so a down memsnapd is logged and the prolog exits 0.
# Set MEMSNAP_PROLOG_STRICT=1 to exit 1 instead, which makes Slurm drain the node.
#
# Settings (environment, or /etc/memsnap/slurm-hooks.env, which is sourced if present):
#   MEMSNAPCTL         memsnapctl to run (default: found on PATH)
#   MEMSNAP_SOCKET     memsnapd socket (default: memsnapctl's, /run/memsnap/memsnapd.sock)
#   MEMSNAP_HOOK_LOG   log file (default /var/log/memsnap/slurm-hooks.log); lines go to syslog too
#   MEMSNAP_PROLOG_STRICT, MEMSNAP_PROLOG_START_WAIT (seconds to wait after a start, default 20)
set -u
# Slurm runs hooks without a search path.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}
HOOKS_ENV=${MEMSNAP_HOOKS_ENV:-/etc/memsnap/slurm-hooks.env}
# shellcheck disable=SC1090
[[ -r $HOOKS_ENV ]] && . "$HOOKS_ENV"
LOG=${MEMSNAP_HOOK_LOG:-/var/log/memsnap/slurm-hooks.log}
JOB=${SLURM_JOB_ID:-?}

log() {
    local line
    line="$(date '+%Y-%m-%dT%H:%M:%S') prolog job $JOB: $*"
    { mkdir -p "$(dirname "$LOG")" && echo "$line" >>"$LOG"; } 2>/dev/null
    command -v logger >/dev/null 2>&1 && logger -t memsnap-prolog -- "job $JOB: $*" 2>/dev/null
    return 0
}

finish() { # finish up|down
    if [[ $1 == down && ${MEMSNAP_PROLOG_STRICT:-0} == 1 ]]; then
        log "MEMSNAP_PROLOG_STRICT=1: failing the prolog (Slurm drains the node)"
        exit 1
    fi
    exit 0
}

MEMSNAPCTL=${MEMSNAPCTL:-$(command -v memsnapctl || true)}
if [[ -z $MEMSNAPCTL ]]; then
    log "memsnapctl not found (set MEMSNAPCTL in $HOOKS_ENV); jobs here run without checkpoints"
    finish down
fi

# The last line memsnapctl printed on stderr, captured through a pipe: never a temp file, whose
# predictable name another user could plant as a symlink for root to write through.
why=""
healthy() {
    local err rc
    err=$(timeout 20 "$MEMSNAPCTL" status 2>&1 >/dev/null)
    rc=$?
    why=${err##*$'\n'}
    return $rc
}

if healthy; then
    finish up
fi
log "memsnapd does not answer: ${why:-no reason given}"

if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null 2>&1; then
    log "starting memsnapd (systemctl start memsnapd)"
    timeout 30 systemctl start memsnapd >/dev/null 2>&1 || log "systemctl start memsnapd failed"
    for ((i = 0; i < ${MEMSNAP_PROLOG_START_WAIT:-20}; i++)); do
        if healthy; then
            log "memsnapd is up"
            finish up
        fi
        sleep 1
    done
fi
log "memsnapd is down: jobs on this node run without checkpoints until it is back"
finish down
