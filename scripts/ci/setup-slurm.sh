#!/usr/bin/env bash
# A local Slurm on this machine, for tests/slurm and scripts/slurm/local.sbatch.
#
# Run as root, no stdin: installs Debian's slurm-wlm and munge, writes a munge key and
# /etc/slurm/slurm.conf, starts munged, slurmctld and the slurmds, and waits until
# `sinfo` shows every node idle (a down or drained node is resumed). Idempotent: when
# Slurm already answers with every node up, it exits 0 at once. Every wait is bounded.
#
# Nodes:
#   partition debug (default): node `hostname`, its CPUs and memory;
#   partition multi: cxnode[1-3], three more slurmds on this host (slurmd -N, own ports),
#     for the templates' node-loss and spare tests; feature nvme like a Frontier node.
set -euo pipefail

HOST=$(hostname)
CONF=/etc/slurm/slurm.conf
MARK="# written by cachex-agent scripts/ci/setup-slurm.sh"
EXTRA=(cxnode1 cxnode2 cxnode3)
NODES=("$HOST" "${EXTRA[@]}")
WAIT=${SLURM_SETUP_WAIT:-60}        # seconds for each daemon / the nodes to come up

say() { echo "setup-slurm: $*"; }
die() { echo "setup-slurm: error: $*" >&2; exit 1; }

node_states() {     # "name state" per node; nothing when slurmctld does not answer
    timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true
}

all_usable() {
    local states node state n=0
    states=$(node_states)
    for node in "${NODES[@]}"; do
        state=$(awk -v n="$node" '$1 == n {print $2}' <<<"$states")
        [[ $state =~ ^(idle|mixed|allocated|completing)$ ]] || return 1
        n=$((n + 1))
    done
    ((n == ${#NODES[@]}))
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

daemons_running() {
    local node
    pgrep -x munged >/dev/null && pid_alive /run/slurmctld.pid || return 1
    for node in "${NODES[@]}"; do pid_alive "/run/slurmd-$node.pid" || return 1; done
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
            && command -v munged >/dev/null && command -v sbatch >/dev/null; then
        return
    fi
    [[ $(id -u) -eq 0 ]] || die "run as root (installs packages, writes /etc/slurm)"
    say "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q </dev/null >/dev/null
    # Package scripts may try to start the daemons (no systemd here): that may fail; we
    # start them ourselves below.
    apt-get install -y -q -o Dpkg::Options::=--force-confold slurm-wlm munge </dev/null \
        >/dev/null 2>&1 || die "apt-get install slurm-wlm munge failed"
}

setup_munge() {
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        say "creating /etc/munge/munge.key"
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    if ! pgrep -x munged >/dev/null; then
        say "starting munged"
        runuser -u munge -- munged --force
    fi
    local deadline=$((SECONDS + WAIT))
    until munge -n 2>/dev/null | unmunge >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "munge -n | unmunge fails after ${WAIT}s (see /var/log/munge)"
        sleep 0.5
    done
}

write_conf() {
    local cpus mem conf
    cpus=$(nproc)
    # slurmd drains a node whose RealMemory is above what it measures: stay 10% under.
    mem=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    conf="$MARK
ClusterName=local
SlurmctldHost=$HOST
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MinJobAge=600
KillWait=10
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
NodeName=$HOST CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=cxnode[1-3] NodeHostname=$HOST Port=[6821-6823] CPUs=$cpus RealMemory=$mem Feature=nvme State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
PartitionName=multi Nodes=cxnode[1-3] Default=NO MaxTime=INFINITE State=UP OverSubscribe=FORCE"
    if [[ -f $CONF ]] && ! grep -qxF "$MARK" "$CONF"; then
        say "keeping $CONF (not written by this script)"
        return
    fi
    if [[ ! -f $CONF ]] || [[ $(cat "$CONF") != "$conf" ]]; then
        say "writing $CONF (nodes ${NODES[*]}: $cpus CPUs, ${mem} MiB each)"
        install -d /etc/slurm
        printf '%s\n' "$conf" >"$CONF.tmp"
        mv "$CONF.tmp" "$CONF"
        # Daemons started with another configuration must re-read it.
        local pidfile
        for pidfile in /run/slurmd.pid /run/slurmd-*.pid /run/slurmctld.pid; do
            stop_daemon "$pidfile"
        done
    fi
}

stop_daemon() {     # PIDFILE: stop the daemon whose pid it holds, bounded
    local pid
    pid=$(cat "$1" 2>/dev/null || true)
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
    say "stopping pid $pid ($1) to apply the new configuration"
    kill "$pid"
    local deadline=$((SECONDS + WAIT))
    while kill -0 "$pid" 2>/dev/null; do
        ((SECONDS < deadline)) || die "pid $pid ($1) did not exit within ${WAIT}s"
        sleep 0.2
    done
}

start_slurm() {
    install -d /var/spool/slurmctld /var/log/slurm
    if ! pid_alive /run/slurmctld.pid; then
        say "starting slurmctld"
        slurmctld
    fi
    local deadline=$((SECONDS + WAIT)) node
    until timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; do
        ((SECONDS < deadline)) || die "slurmctld not up after ${WAIT}s (see /var/log/slurm/slurmctld.log)"
        sleep 0.5
    done
    for node in "${NODES[@]}"; do
        pid_alive "/run/slurmd-$node.pid" && continue
        say "starting slurmd for node $node"
        install -d "/var/spool/slurmd/$node"
        slurmd -N "$node"
    done
}

wait_usable() {
    local deadline=$((SECONDS + WAIT)) node state resumed=0
    until all_usable; do
        # Nodes left down or drained by an earlier run (killed daemons, a node-loss test).
        while read -r node state; do
            if [[ ! $state =~ ^(down|drain|fail) ]] || ((resumed >= 12)); then continue; fi
            say "node $node is $state: scontrol update state=resume"
            timeout 10 scontrol update nodename="$node" state=resume || true
            resumed=$((resumed + 1))
        done <<<"$(node_states)"
        ((SECONDS < deadline)) \
            || die "nodes not idle after ${WAIT}s: $(node_states | tr '\n' ' ')(see /var/log/slurm)"
        sleep 1
    done
}

if command -v sinfo >/dev/null && daemons_running && all_usable; then
    say "Slurm is up: $(node_states | tr '\n' ' ')"
    exit 0
fi
install_packages
setup_munge
write_conf
start_slurm
wait_usable
say "Slurm $(sinfo --version | awk '{print $2}') is up: $(node_states | tr '\n' ' ')"
