#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for the tests and for trying the cluster path on a
# workstation: munged + slurmctld + slurmd (Debian's slurm-wlm 22.05 and munge), all as root, with
# the munge key, state, spool, logs and slurm.conf in one directory (default /tmp/mpt-slurm).
#
#   sudo slurm/local_cluster.sh start    # prints the environment to export (SLURM_CONF)
#   eval "$(sudo slurm/local_cluster.sh env)"
#   slurm/local_cluster.sh status
#   sudo slurm/local_cluster.sh stop     # cancels this cluster's jobs, stops its daemons
#
# Settings (environment): MPT_SLURM_DIR (directory), MPT_SLURM_PORT (slurmctld port; slurmd uses
# the next one), MPT_SLURM_PARTITION (partition name, default "debug"), MPT_SLURM_MAX_ARRAY
# (MaxArraySize, default 1001), MPT_SLURM_KILL_WAIT (seconds between SIGTERM and SIGKILL, default 15),
# MPT_SLURM_CPUS (CPUs the node declares, default nproc; more than the machine has lets more small
# jobs run at once, time-sliced -- the tests do this).
# Nothing here touches /etc: it runs next to a system SLURM without disturbing it.
set -euo pipefail

DIR="${MPT_SLURM_DIR:-/tmp/mpt-slurm}"
PORT="${MPT_SLURM_PORT:-6817}"
PARTITION="${MPT_SLURM_PARTITION:-debug}"
MAX_ARRAY="${MPT_SLURM_MAX_ARRAY:-1001}"
KILL_WAIT="${MPT_SLURM_KILL_WAIT:-15}"
CPUS="${MPT_SLURM_CPUS:-$(nproc)}"
CONF="$DIR/slurm.conf"

die() { echo "local_cluster: $*" >&2; exit 1; }

need() {
    command -v "$1" >/dev/null 2>&1 || die "'$1' not found: install the Debian packages slurm-wlm and munge (apt-get install -y slurm-wlm munge)"
}

pid_alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

print_env() {
    echo "export SLURM_CONF=$CONF"
}

write_conf() {
    local host cpus mem_mb first_id
    host="$(hostname -s)"
    cpus="$CPUS"
    # 90% of physical memory: a node that declares more than it has is drained by slurmd.
    mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
    # Job ids differ between restarts so that ids recorded in a manifest never name a new job.
    first_id=$(( $(date +%s) % 50000000 + 1 ))
    cat > "$CONF" <<EOF
# Written by slurm/local_cluster.sh -- a one-node test cluster; state lives in $DIR.
ClusterName=mpt-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# Containers and workstations have no cgroup delegation: track processes by parent pid.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
JobRequeue=1
KillWait=$KILL_WAIT
MinJobAge=600
MaxArraySize=$MAX_ARRAY
FirstJobId=$first_id
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MessageTimeout=20
DefMemPerCPU=$(( mem_mb / cpus ))
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_ready() {
    local i
    for i in $(seq 1 60); do
        if SLURM_CONF="$CONF" sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            return 0
        fi
        sleep 0.5
    done
    return 1
}

start() {
    [[ "$(id -u)" == 0 ]] || die "start needs root (slurmd launches jobs as their user)"
    need munged; need mungekey; need slurmctld; need slurmd; need sinfo
    if pid_alive "$DIR/slurmctld.pid"; then
        echo "local_cluster: already running in $DIR" >&2
        print_env
        return 0
    fi
    rm -rf "$DIR/state" "$DIR/spool" "$DIR/munge" "$DIR/log"
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/munge" "$DIR/log"
    chmod 700 "$DIR/munge"
    # munged refuses a key readable by others and a socket directory writable by others.
    mungekey --create --force --keyfile="$DIR/munge/munge.key"
    chmod 600 "$DIR/munge/munge.key"
    munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed" \
        || die "munged failed to start; see $DIR/log/munged.log"
    write_conf
    # -c: start from empty state (this cluster is disposable); -i: ignore stale state errors.
    SLURM_CONF="$CONF" slurmctld -c -i -f "$CONF" \
        || die "slurmctld failed to start; see $DIR/log/slurmctld.log"
    SLURM_CONF="$CONF" slurmd -f "$CONF" \
        || die "slurmd failed to start; see $DIR/log/slurmd.log"
    wait_ready || die "node not ready after 30 s; see $DIR/log/slurmctld.log and $DIR/log/slurmd.log"
    echo "local_cluster: ready ($CPUS CPUs, partition '$PARTITION', state in $DIR)" >&2
    print_env
}

stop() {
    if [[ -f "$CONF" ]] && pid_alive "$DIR/slurmctld.pid"; then
        local ids
        ids="$(SLURM_CONF="$CONF" squeue -h -o '%A' 2>/dev/null || true)"
        if [[ -n "$ids" ]]; then
            # shellcheck disable=SC2086
            SLURM_CONF="$CONF" scancel $ids 2>/dev/null || true
            local i
            for i in $(seq 1 $(( KILL_WAIT * 2 + 10 ))); do
                [[ -z "$(SLURM_CONF="$CONF" squeue -h -t R,CG -o '%A' 2>/dev/null)" ]] && break
                sleep 0.5
            done
        fi
    fi
    local f
    for f in slurmd.pid slurmctld.pid munge/munged.pid; do
        if pid_alive "$DIR/$f"; then
            local pid; pid="$(cat "$DIR/$f")"
            kill "$pid" 2>/dev/null || true
            local i
            for i in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$DIR/$f"
    done
    echo "local_cluster: stopped ($DIR)" >&2
}

status() {
    if pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid" && pid_alive "$DIR/munge/munged.pid"; then
        echo "local_cluster: running in $DIR" >&2
        SLURM_CONF="$CONF" sinfo >&2 || true
        print_env
    else
        echo "local_cluster: not running ($DIR)" >&2
        return 1
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) print_env ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
