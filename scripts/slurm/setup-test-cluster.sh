#!/usr/bin/env bash
# Turn this machine into a one-node Slurm cluster for memsnap tests.
#
#   - installs slurm-wlm + munge (Debian 12: Slurm 22.05),
#   - creates /etc/munge/munge.key if missing and starts munged,
#   - writes /etc/slurm/slurm.conf for this host (two partitions on the node:
#     `low` (default, PriorityTier=1, GraceTime=10) and `high` (PriorityTier=10);
#     preempt/partition_prio + PreemptMode=REQUEUE, so a `high` job that needs
#     the resources of a running `low` job preempts and requeues it),
#   - starts slurmctld and slurmd directly (no systemd needed) and waits until
#     the node is usable.
#
# Idempotent: if the config is unchanged and the daemons are up, it does nothing.
# If the generated config differs from the one on disk, the daemons are restarted.
# Refuses to overwrite a slurm.conf it did not write (set FORCE=1 to override).
#
# Environment overrides: GRACE_TIME (10), KILL_WAIT (30), MIN_JOB_AGE (30),
# WAIT_SECS (60).
#
# Tests that need preemption must make the `high` job need the `low` job's
# cores (select/cons_tres, CR_Core), e.g. submit both with --exclusive or
# with -c "$(nproc)".
set -euo pipefail

GRACE_TIME=${GRACE_TIME:-10}
KILL_WAIT=${KILL_WAIT:-30}
MIN_JOB_AGE=${MIN_JOB_AGE:-30}
WAIT_SECS=${WAIT_SECS:-60}

CONF=/etc/slurm/slurm.conf
MARKER="# Managed by memsnap scripts/slurm/setup-test-cluster.sh"
MUNGE_KEY=/etc/munge/munge.key
MUNGE_PID=/run/munge/munged.pid
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
LOG_DIR=/var/log/slurm

export DEBIAN_FRONTEND=noninteractive
export LC_ALL=C

log() { echo "setup-test-cluster: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# pid_alive <pidfile> <comm>: the pidfile names a live process called <comm>.
pid_alive() {
    local pid
    [[ -r $1 ]] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]]
}

# The node's state as sinfo reports it ("" if slurmctld does not answer).
node_state() { timeout 10 sinfo -h -n "$HOST" -o %T 2>/dev/null | head -n1 || true; }

node_ready() {
    case "$(node_state)" in
        idle | mixed | allocated | completing) return 0 ;;
        *) return 1 ;;
    esac
}

install_packages() {
    local missing=() p
    for p in slurm-wlm munge; do
        dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    log "installing ${missing[*]}"
    local aptlog
    aptlog=$(mktemp) || die "mktemp failed"  # never a predictable name in /tmp (root writes it)
    if ! apt-get install -y "${missing[@]}" >"$aptlog" 2>&1; then
        apt-get update >/dev/null
        apt-get install -y "${missing[@]}" >"$aptlog" 2>&1 \
            || { tail -n 30 "$aptlog" >&2; rm -f "$aptlog"; die "apt-get install failed"; }
    fi
    rm -f "$aptlog"
}

setup_munge() {
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s $MUNGE_KEY ]]; then
        log "generating $MUNGE_KEY"
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile="$MUNGE_KEY" --force
        else
            dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
        fi
    fi
    chown munge:munge "$MUNGE_KEY"
    chmod 0400 "$MUNGE_KEY"

    if ! pid_alive "$MUNGE_PID" munged; then
        log "starting munged"
        rm -f /run/munge/munge.socket.2.lock
        runuser -u munge -- /usr/sbin/munged
    fi
    local i
    for ((i = 0; i < 20; i++)); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    die "munge does not work (see /var/log/munge/munged.log)"
}

generate_conf() {
    local cpus mem_total real_mem
    cpus=$(nproc)
    mem_total=$(free -m | awk '/^Mem:/ { print $2 }')
    # A bit below the total, so slurmd never finds less than configured
    # (that would drain the node with "Low RealMemory").
    real_mem=$((mem_total * 95 / 100))
    cat <<EOF
$MARKER
# One-node test cluster on host '$HOST'. Regenerated on every run.
ClusterName=memsnap-test
SlurmctldHost=$HOST(127.0.0.1)
AuthType=auth/munge
CryptoType=crypto/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true

# No cgroups: plain process tracking, no task binding/confinement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none

SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=$KILL_WAIT
MinJobAge=$MIN_JOB_AGE
SlurmdTimeout=60
InactiveLimit=0

# A job in 'high' preempts (requeues) a job in 'low' whose resources it needs.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE

NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$real_mem State=UNKNOWN
PartitionName=low Nodes=$HOST Default=YES PriorityTier=1 GraceTime=$GRACE_TIME MaxTime=INFINITE State=UP
PartitionName=high Nodes=$HOST Default=NO PriorityTier=10 MaxTime=INFINITE State=UP
EOF
}

stop_slurm_daemons() {
    log "stopping slurm daemons"
    timeout 10 scontrol shutdown >/dev/null 2>&1 || true
    local i
    for ((i = 0; i < 20; i++)); do
        pid_alive "$CTLD_PID" slurmctld || pid_alive "$SLURMD_PID" slurmd || return 0
        sleep 0.5
    done
    local f
    for f in "$CTLD_PID:slurmctld" "$SLURMD_PID:slurmd"; do
        if pid_alive "${f%%:*}" "${f##*:}"; then
            kill "$(cat "${f%%:*}")" 2>/dev/null || true
        fi
    done
    sleep 1
}

main() {
    [[ $(id -u) -eq 0 ]] || die "must run as root"
    HOST=$(hostname -s)
    [[ -n $HOST ]] || die "empty hostname"

    install_packages
    setup_munge

    local new changed=0
    new=$(generate_conf)
    if [[ -e $CONF ]] && ! grep -qxF "$MARKER" "$CONF" && [[ ${FORCE:-0} != 1 ]]; then
        die "$CONF exists and was not written by this script; set FORCE=1 to overwrite"
    fi
    if [[ ! -e $CONF ]] || [[ $(cat "$CONF") != "$new" ]]; then
        log "writing $CONF"
        install -d -m 0755 /etc/slurm
        printf '%s\n' "$new" >"$CONF.tmp"
        chmod 0644 "$CONF.tmp"
        mv -f "$CONF.tmp" "$CONF"
        changed=1
    fi

    if [[ $changed == 0 ]] && pid_alive "$CTLD_PID" slurmctld && pid_alive "$SLURMD_PID" slurmd && node_ready; then
        log "cluster already up: node $HOST is $(node_state)"
        return 0
    fi
    if [[ $changed == 1 ]] && { pid_alive "$CTLD_PID" slurmctld || pid_alive "$SLURMD_PID" slurmd; }; then
        stop_slurm_daemons
    fi

    install -d -m 0755 /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR"
    if ! pid_alive "$CTLD_PID" slurmctld; then
        log "starting slurmctld"
        /usr/sbin/slurmctld # daemonizes; log: $LOG_DIR/slurmctld.log
    fi
    if ! pid_alive "$SLURMD_PID" slurmd; then
        log "starting slurmd"
        /usr/sbin/slurmd # daemonizes; log: $LOG_DIR/slurmd.log
    fi

    local deadline=$((SECONDS + WAIT_SECS)) state resumed=0
    while ((SECONDS < deadline)); do
        state=$(node_state)
        case "$state" in
            idle | mixed | allocated | completing)
                log "cluster up: node $HOST is $state"
                sinfo >&2
                return 0
                ;;
            down* | drain* | fail*)
                # e.g. left DOWN/DRAINED by an earlier run: put it back in service.
                if [[ $resumed == 0 ]]; then
                    log "node $HOST is '$state'; resuming it"
                    scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
                    resumed=1
                fi
                ;;
        esac
        sleep 1
    done
    tail -n 20 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 || true
    die "node $HOST not ready after ${WAIT_SECS}s (state: '${state:-no answer}')"
}

main "$@"
