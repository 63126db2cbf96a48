#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/path/to/epilog.sh) for memsnap.
#
# After every run of a job on this node, `memsnapctl slurm epilog` (memsnap/slurm/hooks.py):
#   - waits (bounded) for a checkpoint of the job that memsnapd is still dumping;
#   - handles a workload of the job that still runs (its launcher is gone): on a requeue it is
#     checkpointed with stop first, otherwise (or if that fails) it is killed;
#   - when the job really ended (completed, failed, cancelled, timed out; not requeued), deletes the
#     job's checkpoints (tier, store, catalog). On a requeue they stay for the next run.
# A job that never used memsnap costs two quick RPCs. slurmctld is asked (scontrol show job) only
# for jobs that have something in memsnapd.
#
# It never fails the node: every problem is logged and the epilog exits 0.
#
# Settings (environment, or /etc/memsnap/slurm-hooks.env, which is sourced if present):
#   MEMSNAPCTL, MEMSNAP_SOCKET, MEMSNAP_HOOK_LOG  as for prolog.sh
#   MEMSNAP_EPILOG_KEEP=1        keep the checkpoints of jobs that really ended
#   MEMSNAP_EPILOG_TIMEOUT       overall limit in seconds (default 280; keep it below
#                                PrologEpilogTimeout)
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}
HOOKS_ENV=${MEMSNAP_HOOKS_ENV:-/etc/memsnap/slurm-hooks.env}
# shellcheck disable=SC1090
[[ -r $HOOKS_ENV ]] && . "$HOOKS_ENV"
LOG=${MEMSNAP_HOOK_LOG:-/var/log/memsnap/slurm-hooks.log}
JOB=${SLURM_JOB_ID:-}

log() {
    local line
    line="$(date '+%Y-%m-%dT%H:%M:%S') epilog job ${JOB:-?}: $*"
    { mkdir -p "$(dirname "$LOG")" && echo "$line" >>"$LOG"; } 2>/dev/null
    command -v logger >/dev/null 2>&1 && logger -t memsnap-epilog -- "job ${JOB:-?}: $*" 2>/dev/null
    return 0
}

if [[ -z $JOB ]]; then
    log "SLURM_JOB_ID is not set; nothing to do"
    exit 0
fi
MEMSNAPCTL=${MEMSNAPCTL:-$(command -v memsnapctl || true)}
if [[ -z $MEMSNAPCTL ]]; then
    log "memsnapctl not found (set MEMSNAPCTL in $HOOKS_ENV)"
    exit 0
fi

TOTAL=${MEMSNAP_EPILOG_TIMEOUT:-280}
# Leave room inside TOTAL for the rescue checkpoint after the wait for a running dump.
PHASE=$(( TOTAL > 30 ? (TOTAL - 10) / 2 : 10 ))
out=$(timeout -k 5 "$TOTAL" "$MEMSNAPCTL" slurm epilog --job-id "$JOB" \
        --dump-wait "$PHASE" --rescue-timeout "$PHASE" 2>&1)
rc=$?
case "$out" in
    *": untouched") ;; # not a memsnap job: stay quiet
    *) log "$out" ;;
esac
[[ $rc == 0 ]] || log "memsnapctl slurm epilog failed (exit $rc); ignored"
exit 0
