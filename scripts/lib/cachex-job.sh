# shellcheck shell=bash
# cachex-job.sh: the job logic shared by scripts/slurm/*.sbatch and scripts/pbs/*.pbs.
#
# A template sets its site variables (see docs/jobs.md), sources this file and calls
# `cx_main`. What happens:
#
#   0. MODULES loaded (`module load`); STAGE_VENV=1: the venv, packed once into a tar,
#      broadcast with sbcast to STAGE_DIR on every node of the job and unpacked there;
#      the agent, check and recovery steps then run from that copy;
#   1. the node set: the first NODES hosts of the allocation (sorted like cachex numbers
#      nodes) not in EXCLUDE_NODES, the others are spares (fewer than NODES, down to
#      MIN_NODES, when hosts are missing); or VNODES virtual nodes on one host (tests);
#   2. the cachex configuration: $CACHEX_CONFIG if it names a file, else one written from
#      the variables (RUN_NAME, SPOOL, STAGE, CACHE, PFS, FAILURE_DOMAIN, ...);
#   3. RESUME=auto and the run has a flushed checkpoint (an earlier job): `cachex recover`;
#   4. the agent step (one agent per node, in the background), the training step;
#   5. training fails: the nodes still up are found, lost ones replaced by spares; with
#      too few spares and MIN_NODES > 0 the job goes on with fewer nodes, down to
#      MIN_NODES (`cachex recover` places the checkpoint onto them), the agent step stopped
#      (`cachex stop`, a bounded wait, then killed), `cachex recover` on the node set
#      (one rank per node), the agent step restarted, training relaunched with
#      RESUME_ARGS; at most MAX_RELAUNCHES times;
#   6. HALT_MARGIN seconds before the job's end: no more relaunches; a running trainer
#      gets SIGTERM (then SIGKILL after TRAIN_STOP_GRACE); then the final drain;
#   7. the final drain: `cachex stop`, wait for the agent step, and the newest
#      checkpoint must be at level `flushed` (on the PFS).
#
# Exit status: 0 when training finished (or halted before the walltime, HALT_EXIT) and
# the newest checkpoint reached the PFS; 1 on a failure (one line says which); 2 for a
# bad variable. Every wait is bounded.
#
# The scheduler part is small: cx_<slurm|pbs>_{hosts,alive,launcher,signal,job_end}.

CX_STEP_AGENTS=cachex-agents
CX_STEP_RECOVER=cachex-recover
CX_STEP_PREPARE=cachex-prepare
CX_STEP_TRAIN=train
CX_STEP_STAGE=cachex-stage
# On every node: the broadcast tar becomes STAGE_DIR whole (unpacked aside, then renamed);
# a directory there that is not an earlier staged copy is never removed.
# shellcheck disable=SC2016  # expanded by the node's bash, $1 = STAGE_DIR
CX_UNPACK='set -e; d=$1; rm -rf "$d.new"; mkdir -p "$d.new"; tar -xf "$d.tar" -C "$d.new"; rm -f "$d.tar"; touch "$d.new/.cachex-staged"; if [ -e "$d" ]; then [ -f "$d/.cachex-staged" ] || { echo "cachex-unpack: $d exists and is no staged venv: not replaced" >&2; exit 1; }; rm -rf "$d"; fi; mv "$d.new" "$d"'

# ---------------------------------------------------------------- defaults
: "${RUN_NAME:=${SLURM_JOB_NAME:-${PBS_JOBNAME:-cachex}}}"
: "${FAILURE_DOMAIN:=node}"
: "${COMMIT_RULE:=auto}"
: "${CONFIG_EXTRA:=}"
: "${RANKS_PER_NODE:=1}"
: "${MODULE_USE:=}"
: "${MODULE_PURGE:=0}"
: "${CRAY_LD_FIRST:=0}"
: "${MASTER_ADDR_FROM:=name}"   # name | address: MASTER_ADDR as the first node's name or IP
: "${SPARES:=0}"
: "${VNODES:=}"
: "${RESUME_ARGS=--resume}"
: "${RESUME:=auto}"
: "${HALT_MARGIN:=600}"
: "${HALT_EXIT:=0}"
: "${MAX_RELAUNCHES:=3}"
: "${MAX_AGENT_RESTARTS:=3}"
: "${AGENT_START_TIMEOUT:=300}"
: "${AGENT_STOP_TIMEOUT:=120}"
: "${DRAIN_TIMEOUT:=900}"
: "${RECOVER_TIMEOUT:=1800}"
: "${TRAIN_STOP_GRACE:=60}"
: "${POLL:=2}"
: "${NODE_DIRS:=}"
: "${SRUN_MPI=pmi2}"            # empty: no --mpi, the site's default plugin
: "${MODULES:=}"
: "${TRAIN_ENV:=}"
: "${AGENT_ENV_UNSET:=}"
: "${STAGE_VENV:=0}"
: "${STAGE_DIR:=}"
: "${STAGE_TAR:=}"
: "${EXCLUDE_NODES:=}"
: "${MIN_NODES:=0}"
: "${SRUN_AGENT_FLAGS:=}"
: "${SRUN_TRAIN_FLAGS:=}"
: "${MPIEXEC:=mpiexec}"
: "${MPIEXEC_FLAVOR:=hydra}"
: "${MPIEXEC_AGENT_FLAGS:=}"
: "${MPIEXEC_TRAIN_FLAGS:=}"
: "${CX_PLAN:=0}"

CX_AGENTS_PID=
CX_TRAIN_PID=
CX_AGENTS_LIFE0=-
CX_HALT_AT=
CX_BAD=()
CX_JOB_END=
CX_CHECKED=0
CX_HALTED=0
CX_SET=()
CX_SPARE=()
CX_UP=()

# ---------------------------------------------------------------- helpers
cx_log() { printf '%s cachex-job: %s\n' "$(date +%H:%M:%S)" "$*"; }

cx_die() {      # MESSAGE [STATUS]: one line on stderr, then exit
    printf '%s cachex-job: error: %s\n' "$(date +%H:%M:%S)" "$1" >&2
    exit "${2:-1}"
}

cx_join() { local IFS=$1; shift; echo "$*"; }

cx_virtual() { [[ -n $VNODES ]]; }

cx_nodes() { if cx_virtual; then echo "$VNODES"; else echo "${#CX_SET[@]}"; fi; }

cx_now() { date +%s; }

cx_alive_pid() { [[ -n ${1:-} ]] && kill -0 "$1" 2>/dev/null; }

cx_wait_pid() {     # PID SECONDS: reap PID within SECONDS, its status in CX_RC; 1 on timeout
    local pid=$1 deadline=$(($(cx_now) + $2))
    CX_RC=0
    while cx_alive_pid "$pid"; do
        (($(cx_now) < deadline)) || return 1
        sleep 0.5
    done
    wait "$pid" 2>/dev/null || CX_RC=$?
}

cx_descendants() {  # PID: every descendant process id, deepest first
    local child
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        cx_descendants "$child"
        echo "$child"
    done
}

cx_kill_tree() {    # PID: SIGKILL a launcher and every process it started
    local pids
    pids=$(cx_descendants "$1")
    # shellcheck disable=SC2086  # one word per pid
    kill -KILL "$1" $pids 2>/dev/null || true
}

cx_words() {        # NAME STRING: NAME=(words of STRING, shell quoting honoured)
    eval "$1=( $2 )"
}

cx_bin() { echo "$CX_BIN/$1"; }

# ---------------------------------------------------------------- checks and set-up
cx_check() {
    local var
    for var in CX_SCHEDULER CX_BIN TRAIN_CMD RUN_NAME; do
        [[ -n ${!var:-} ]] || cx_die "$var is not set (see the variables at the top of the template)" 2
    done
    [[ $CX_SCHEDULER == slurm || $CX_SCHEDULER == pbs ]] \
        || cx_die "CX_SCHEDULER=$CX_SCHEDULER: expected slurm or pbs" 2
    [[ $CX_PLAN == 1 || -x $CX_BIN/cachex-agent ]] \
        || cx_die "CX_BIN=$CX_BIN: no cachex-agent there (make venv, or pip install cachex-agent)" 2
    for var in SPARES RANKS_PER_NODE HALT_MARGIN MAX_RELAUNCHES MAX_AGENT_RESTARTS \
               AGENT_START_TIMEOUT AGENT_STOP_TIMEOUT DRAIN_TIMEOUT RECOVER_TIMEOUT \
               TRAIN_STOP_GRACE MIN_NODES; do
        [[ ${!var} =~ ^[0-9]+$ ]] || cx_die "$var=${!var}: expected a whole number" 2
    done
    [[ $POLL =~ ^[0-9]*\.?[0-9]+$ ]] || cx_die "POLL=$POLL: expected seconds" 2
    [[ -z $VNODES || $VNODES =~ ^[1-9][0-9]*$ ]] || cx_die "VNODES=$VNODES: expected a number > 0" 2
    [[ $RESUME =~ ^(auto|yes|no)$ ]] || cx_die "RESUME=$RESUME: expected auto, yes or no" 2
    for var in STAGE_VENV MODULE_PURGE CRAY_LD_FIRST; do
        [[ ${!var} =~ ^[01]$ ]] || cx_die "$var=${!var}: expected 0 or 1" 2
    done
    [[ $MASTER_ADDR_FROM =~ ^(name|address)$ ]] \
        || cx_die "MASTER_ADDR_FROM=$MASTER_ADDR_FROM: expected name or address" 2
    if ((STAGE_VENV)); then
        [[ $CX_SCHEDULER == slurm ]] \
            || cx_die "STAGE_VENV=1: staging uses Slurm's sbcast, which $CX_SCHEDULER has not; set STAGE_VENV=0" 2
        [[ $STAGE_DIR == /?* && $STAGE_DIR != */ ]] \
            || cx_die "STAGE_DIR=$STAGE_DIR: expected an absolute node-local directory (STAGE_VENV=1)" 2
    fi
    [[ $AGENT_ENV_UNSET =~ ^[A-Za-z_][A-Za-z0-9_\ ]*$|^$ ]] \
        || cx_die "AGENT_ENV_UNSET=$AGENT_ENV_UNSET: expected variable names" 2
}

cx_load_modules() {     # MODULE_USE, MODULES: `module use` the directories, `module load`
                        # the modules in this shell, whose steps inherit it
    [[ -n $MODULES ]] || return 0
    local -a mods dirs
    cx_words mods "$MODULES"
    cx_words dirs "${MODULE_USE:-}"
    type module >/dev/null 2>&1 \
        || cx_die "MODULES=$MODULES but this shell has no \`module\` command (source the site's module init first, or set MODULES=)" 2
    local rc=0 dir
    set +eu     # module functions (Lmod, Environment Modules) are not written for -eu
    # a purge first where the site's examples do (Neuron): the batch shell inherits the
    # login node's modules, which may not be the ones the venv was built under
    if ((MODULE_PURGE)); then module purge || rc=$?; fi
    for dir in "${dirs[@]}"; do
        module use "$dir" || rc=$?
    done
    if ((rc == 0)); then
        module load "${mods[@]}"
        rc=$?
    fi
    set -eu
    ((rc == 0)) || cx_die "module use ${dirs[*]} / load ${mods[*]} failed with status $rc (MODULE_USE, MODULES)" 2
    if ((CRAY_LD_FIRST)); then     # a non-default Cray PE: its libraries before the defaults
        export LD_LIBRARY_PATH=${CRAY_LD_LIBRARY_PATH:-}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
    cx_log "modules: $( ((MODULE_PURGE)) && echo 'purge; ')${dirs[*]:+use ${dirs[*]}; }${mods[*]}"
}

cx_rundir() { mkdir -p "$CX_RUNDIR" && chmod 700 "$CX_RUNDIR"; }   # private: host lists, errors

cx_job_id() { echo "${SLURM_JOB_ID:-${PBS_JOBID:-local}}"; }

cx_cachex() {       # the cachex of the venv; in a plan (CX_PLAN=1, no venv yet) PATH's
    if [[ -x $CX_BIN/cachex || $CX_PLAN != 1 ]]; then echo "$CX_BIN/cachex"; else echo cachex; fi
}

cx_job() {          # ARGS...: `cachex job ARGS`; its lines into CX_JOB_OUT, its one-line
                    # error (without the prefix) into CX_JOB_ERR; returns its status
    local err=$CX_RUNDIR/job.err rc=0
    cx_rundir
    CX_JOB_OUT=$("$(cx_cachex)" job "$@" 2>"$err") || rc=$?
    CX_JOB_ERR=$(tail -n 1 "$err")
    CX_JOB_ERR=${CX_JOB_ERR#cachex: error: }
    return "$rc"
}

cx_node_lines() {   # CX_JOB_OUT's `nodes`, `spares`, `up` and `note` lines: CX_SET,
                    # CX_SPARE, CX_UP, the log
    local key rest
    while read -r key rest; do
        case $key in
            nodes) read -r -a CX_SET <<<"$rest" ;;
            spares) read -r -a CX_SPARE <<<"$rest" ;;
            up) read -r -a CX_UP <<<"$rest" ;;
            note) cx_log "$rest" ;;
        esac
    done <<<"$CX_JOB_OUT"
}

cx_init_nodes() {   # CX_SET, CX_SPARE: the package chooses (cachex job nodes)
    local hosts
    hosts=$("cx_${CX_SCHEDULER}_hosts" | tr '\n' ' ')
    [[ -n ${hosts// /} ]] || cx_die "no hosts in the allocation"
    if cx_virtual; then
        CX_SET=("${hosts%% *}")
        CX_SPARE=()
        cx_log "node set: $VNODES virtual nodes on ${CX_SET[0]}"
        return
    fi
    local -a nodes=()
    [[ -z ${NODES:-} ]] || nodes=(--nodes "$NODES")
    local exclude=$EXCLUDE_NODES
    local -a bad
    read -r -a bad <<<"$("cx_${CX_SCHEDULER}_bad_at_start")"
    if ((${#bad[@]})); then
        cx_log "the scheduler marks these nodes of the job down or offline at its start: ${bad[*]} (left out)"
        exclude="$exclude${exclude:+,}$(cx_join , "${bad[@]}")"
    fi
    cx_job nodes --hosts "$hosts" "${nodes[@]}" --spares "$SPARES" \
        --exclude "$exclude" --min-nodes "$MIN_NODES" || cx_die "$CX_JOB_ERR" 2
    cx_node_lines
}

cx_init_config() {
    if [[ -n ${CACHEX_CONFIG:-} && -f ${CACHEX_CONFIG:-} ]]; then
        cx_log "configuration: $CACHEX_CONFIG"
        export CACHEX_CONFIG
        return
    fi
    local var
    for var in SPOOL STAGE CACHE PFS; do
        [[ -n ${!var:-} ]] || cx_die "$var is not set and CACHEX_CONFIG names no file" 2
    done
    local out=${CONFIG_OUT:-$PFS/cachex-$RUN_NAME.toml} target
    target=$out
    if [[ $CX_PLAN == 1 ]]; then
        target=$CX_RUNDIR/plan.toml     # checked, not written where the job would
    else
        mkdir -p "$PFS" || cx_die "cannot create $PFS (PFS)"
    fi
    # written and read back by the agents' own parser: a bad value ends the job here
    cx_job config --out "$target" --run "$RUN_NAME" --spool "$SPOOL" --stage "$STAGE" \
        --cache "$CACHE" --pfs "$PFS" --domain "$FAILURE_DOMAIN" --exclude "$EXCLUDE_NODES" \
        --min-nodes "$MIN_NODES" --rule "$COMMIT_RULE" --extra "$CONFIG_EXTRA" \
        --job "$(cx_job_id)" || cx_die "$CX_JOB_ERR" 2
    export CACHEX_CONFIG=$out
    cx_log "configuration: $out (written from the template's variables)"
}

cx_init_halt() {    # the halt at HALT_MARGIN before the end: JOB_END (epoch seconds, this
                    # host's clock), else the time left as the scheduler states it
    local end=${JOB_END:-} left
    if [[ -z $end ]]; then
        left=$("cx_${CX_SCHEDULER}_left" 2>/dev/null || true)
        [[ $left =~ ^[0-9]+$ ]] && end=$(($(cx_now) + left))
    fi
    if [[ $end =~ ^[0-9]+$ ]]; then
        CX_JOB_END=$end
        CX_HALT_AT=$((end - HALT_MARGIN))
        (($(cx_now) < CX_HALT_AT)) \
            || cx_die "HALT_MARGIN=${HALT_MARGIN}s leaves no time to train: the job ends at $(date -d "@$end" +%H:%M:%S)" 2
        cx_log "job ends at $(date -d "@$end" +%H:%M:%S); halt at $(date -d "@$CX_HALT_AT" +%H:%M:%S) (HALT_MARGIN=${HALT_MARGIN}s)"
    else
        CX_HALT_AT=
        cx_log "no job end time known: no halt before the walltime"
    fi
}

cx_past_halt() { [[ -n $CX_HALT_AT ]] && (($(cx_now) >= CX_HALT_AT)); }

# The scheduler's own warning (Slurm: `#SBATCH --signal=B:USR1@<HALT_MARGIN>`, sent to
# this batch shell): halt now, whatever the end time read at the start said. The job's
# end is then at most HALT_MARGIN away.
cx_on_warning() {
    local now
    now=$(cx_now)
    cx_log "USR1: the scheduler warns that the job ends soon: halting now"
    CX_HALT_AT=$now
    if [[ -z ${CX_JOB_END:-} ]] || ((CX_JOB_END > now + HALT_MARGIN)); then
        CX_JOB_END=$((now + HALT_MARGIN))
    fi
}

cx_fit() {      # SECONDS [halt]: that timeout, cut to what is left of the job (minus 30 s);
                # with `halt`, to what is left before the halt, so that a recovery or a
                # restart never eats the final drain's window
    local want=$1 until=${CX_JOB_END:-} left
    if [[ ${2:-} == halt && -n ${CX_HALT_AT:-} ]]; then until=$((CX_HALT_AT + 30)); fi
    [[ -n $until ]] || { echo "$want"; return; }
    left=$((until - $(cx_now) - 30))
    ((left < 1)) && left=1
    echo $((want < left ? want : left))
}

# ---------------------------------------------------------------- commands
# The commands each step runs, whatever the launcher (the same under Slurm and PBS).
cx_cmd() {          # KIND [resume]: prints the command, one word per line
    case $1 in
        agents) cx_node_bin cachex-agent; printf '%s\n' --config "$CACHEX_CONFIG" ;;
        check) cx_node_bin cachex-agent; printf '%s\n' --config "$CACHEX_CONFIG" --check ;;
        recover) cx_node_bin cachex; printf '%s\n' recover --config "$CACHEX_CONFIG" ;;
        unpack) printf '%s\n' bash -c "$CX_UNPACK" cachex-unpack "$STAGE_DIR" ;;
        stop) printf '%s\n' "$(cx_bin cachex)" stop --config "$CACHEX_CONFIG" --timeout "$2" ;;
        prepare) printf '%s\n' mkdir -p "${CX_NODE_DIRS[@]}" ;;
        train)
            local -a words resume=()
            cx_words words "$TRAIN_CMD"
            [[ ${2:-} == resume ]] && cx_words resume "$RESUME_ARGS"
            printf '%s\n' "${words[@]}" "${resume[@]}"
            ;;
    esac
}

cx_node_bin() {     # NAME: how a node step runs a cachex program, one word a line:
                    # from the staged copy (its own python: the entry script's #! names
                    # the shared venv) or from CX_BIN
    if ((STAGE_VENV)); then
        printf '%s\n' "$STAGE_DIR/bin/python" "$STAGE_DIR/bin/$1"
    else
        cx_bin "$1"
    fi
}

cx_step() {         # KIND PPN [ARG]: CX_ARGV=(launcher + command) of a step
    local kind=$1 ppn=$2 name
    case $kind in
        agents | check) name=$CX_STEP_AGENTS ;; recover) name=$CX_STEP_RECOVER ;;
        prepare) name=$CX_STEP_PREPARE ;; train) name=$CX_STEP_TRAIN ;;
        unpack) name=$CX_STEP_STAGE ;;
    esac
    "cx_${CX_SCHEDULER}_launcher" "$name" "$kind" "$ppn"
    cx_step_env "$kind"
    local -a cmd
    mapfile -t cmd < <(cx_cmd "$kind" "${3:-}")
    CX_ARGV=("${CX_LAUNCH[@]}" "${cmd[@]}")
}

cx_step_env() {     # KIND: TRAIN_ENV for the training step only; AGENT_ENV_UNSET out of
                    # every other step (on Frontier: MPICH_GPU_SUPPORT_ENABLED, with which
                    # Cray MPICH exits unless the GTL library is linked; the agents' buffers
                    # are host memory)
    local -a pre=(env) words=()
    local var
    if [[ $1 == train ]]; then
        cx_words words "$TRAIN_ENV"
        pre+=("${words[@]}")
    else
        for var in $AGENT_ENV_UNSET; do pre+=(-u "$var"); done
    fi
    ((${#pre[@]} == 1)) || CX_LAUNCH=("${pre[@]}" "${CX_LAUNCH[@]}")
}

cx_status() {       # the run's state into CX_ST_* (cachex job state); "-" when unknown
    local line
    line=$(timeout 60 "$(cx_cachex)" job state --config "$CACHEX_CONFIG" 2>/dev/null) || line=
    read -r CX_ST_STATE CX_ST_LIFE CX_ST_NEWEST CX_ST_LEVEL CX_ST_USABLE CX_ST_FLUSHED \
        <<<"${line:-- - - - 0 0}"
}

cx_withdraw_stop() {    # a stop request that no agent read (they had died) would stop the
                        # next agents: the package removes the run's requests
    timeout 60 "$(cx_cachex)" job withdraw-stop --config "$CACHEX_CONFIG" 2>/dev/null || true
}

cx_at_risk() {      # WHEN: what a node loss or the job's end would cost now, in the log
    local out
    if out=$(timeout 60 "$(cx_bin cachex)" status --at-risk --config "$CACHEX_CONFIG" 2>&1); then
        cx_log "$1: ${out%%$'\n'*}"
        [[ $out == *$'\n'* ]] && printf '%s\n' "${out#*$'\n'}" | sed 's/^/    /'
    else
        cx_log "$1: work at risk not known: ${out##*$'\n'}"
    fi
    return 0
}

# ---------------------------------------------------------------- staging
cx_venv() { dirname "$CX_BIN"; }

cx_stage_tar() { echo "${STAGE_TAR:-$(cx_venv).tar}"; }

cx_stage_pack() {   # the packed copy of the venv: made once, again when packages changed
    local venv tar sp stale=1
    venv=$(cx_venv)
    tar=$(cx_stage_tar)
    if [[ -f $tar ]]; then
        stale=0
        for sp in "$venv"/lib/python*/site-packages; do [[ $sp -nt $tar ]] && stale=1; done
    fi
    ((stale)) || return 0
    cx_log "packing $venv into $tar (once; again after a package changes)"
    tar -C "$venv" -cf "$tar.tmp.$$" . || { rm -f "$tar.tmp.$$"; cx_die "cannot pack $venv into $tar (STAGE_TAR)"; }
    mv "$tar.tmp.$$" "$tar"
}

cx_stage() {        # STAGE_VENV=1: the venv to STAGE_DIR on every node of the job
    ((STAGE_VENV)) || return 0
    [[ $CX_PLAN == 1 ]] || cx_stage_pack
    "cx_${CX_SCHEDULER}_broadcast"
    # sbcast can leave partial files behind when it fails: never use them
    cx_exec stage \
        || cx_die "sbcast of $(cx_stage_tar) failed (STAGE_VENV=0 reads the venv from the shared file system)"
    cx_step unpack 1
    cx_exec unpack || cx_die "unpacking the venv into $STAGE_DIR failed on a node"
}

cx_exec() {         # KIND: run CX_ARGV and wait; CX_PLAN=1: print it as `plan KIND: ...`
    if [[ $CX_PLAN == 1 ]]; then
        printf 'plan %s:' "$1"
        printf ' %q' "${CX_ARGV[@]}"
        printf '\n'
        return 0
    fi
    cx_log "$1: ${CX_ARGV[*]}"
    "${CX_ARGV[@]}" </dev/null
}

# ---------------------------------------------------------------- agents
cx_agents_start() {     # the agent step, in the background
    if [[ ${#CX_NODE_DIRS[@]} -gt 0 ]]; then
        cx_step prepare 1
        cx_exec prepare || cx_die "could not create ${CX_NODE_DIRS[*]} on the nodes"
    fi
    if ((CX_CHECKED == 0)); then    # once per job: the agents' checks, same launcher
        cx_step check 1
        cx_exec check || cx_die "the agents' pre-flight check failed (its message is above)" 2
        CX_CHECKED=1
    fi
    cx_step agents 1
    if [[ $CX_PLAN == 1 ]]; then cx_exec agents; return; fi
    cx_log "agents: ${CX_ARGV[*]}"
    cx_status       # the coordinator's life before this start (its status may be left)
    CX_AGENTS_LIFE0=$CX_ST_LIFE
    "${CX_ARGV[@]}" </dev/null &
    CX_AGENTS_PID=$!
}

cx_agents_wait_ready() {    # bounded: live agents of this start (a coordinator's life other
                            # than the one before it: no clock of two hosts compared)
    local deadline=$(($(cx_now) + AGENT_START_TIMEOUT))
    while :; do
        cx_status
        if [[ $CX_ST_STATE == running && $CX_ST_LIFE != - && $CX_ST_LIFE != "$CX_AGENTS_LIFE0" ]]; then
            cx_log "agents running on $(cx_nodes) nodes"
            return
        fi
        if ! cx_alive_pid "$CX_AGENTS_PID"; then
            cx_wait_pid "$CX_AGENTS_PID" 5 || CX_RC='?'
            CX_AGENTS_PID=
            cx_die "the agent step exited with status $CX_RC before it was running (see its messages above)"
        fi
        (($(cx_now) < deadline)) \
            || cx_die "the agents did not report running within ${AGENT_START_TIMEOUT}s (AGENT_START_TIMEOUT)"
        sleep 1
    done
}

cx_agents_stop() {      # SECONDS: drain and stop; returns the agent step's status
    local timeout rc out
    timeout=$(cx_fit "$1")
    [[ -n $CX_AGENTS_PID ]] || return 0
    if cx_alive_pid "$CX_AGENTS_PID"; then
        cx_log "stopping the agents: cachex stop --timeout $timeout"
        local -a cmd
        mapfile -t cmd < <(cx_cmd stop "$timeout")
        out=$(timeout $((timeout + 30)) "${cmd[@]}" 2>&1) || cx_log "cachex stop: ${out##*$'\n'}"
    fi
    if cx_wait_pid "$CX_AGENTS_PID" 30; then
        rc=$CX_RC
    else
        cx_log "the agent step is still running: killing it"
        "cx_${CX_SCHEDULER}_signal" "$CX_STEP_AGENTS" "$CX_AGENTS_PID" KILL
        if cx_wait_pid "$CX_AGENTS_PID" 30; then rc=$CX_RC; else cx_kill_tree "$CX_AGENTS_PID"; rc=137; fi
    fi
    CX_AGENTS_PID=
    cx_withdraw_stop
    cx_log "agent step ended with status $rc"
    return "$rc"
}

cx_agents_watch() {     # during training: an agent step that died is restarted
    [[ -n $CX_AGENTS_PID ]] || return 0
    cx_alive_pid "$CX_AGENTS_PID" && return 0
    cx_wait_pid "$CX_AGENTS_PID" 5 || CX_RC='?'
    CX_AGENTS_PID=
    if ((CX_AGENT_RESTARTS >= MAX_AGENT_RESTARTS)); then
        cx_log "the agent step exited ($CX_RC); not restarted (MAX_AGENT_RESTARTS=$MAX_AGENT_RESTARTS)"
        return 0
    fi
    CX_AGENT_RESTARTS=$((CX_AGENT_RESTARTS + 1))
    cx_log "the agent step exited ($CX_RC) while training runs: restarting it"
    cx_withdraw_stop
    cx_agents_start
}

# ---------------------------------------------------------------- training
cx_train() {        # [resume]: runs the training step; returns its status
    cx_step train "$RANKS_PER_NODE" "${1:-}"
    cx_log "training: ${CX_ARGV[*]}"
    MASTER_ADDR=$(cx_master_addr)
    export MASTER_ADDR
    cx_rundir
    : >"$CX_RUNDIR/train.err"
    # its errors also into a file, which names the nodes to blame if it fails
    "${CX_ARGV[@]}" </dev/null 2> >(tee -a "$CX_RUNDIR/train.err" >&2) &
    CX_TRAIN_PID=$!
    while cx_alive_pid "$CX_TRAIN_PID"; do
        if cx_past_halt; then
            cx_halt_training
            break
        fi
        cx_agents_watch
        sleep "$POLL"
    done
    local rc=0
    if ((CX_HALTED)); then rc=$CX_RC; else wait "$CX_TRAIN_PID" 2>/dev/null || rc=$?; fi
    CX_TRAIN_PID=
    return "$rc"
}

cx_master_addr() {  # the first training node (rank 0) by name, or by its address where
                    # the site asks for one (Frontier: `hostname -i`, here resolved for
                    # that node, which need not be the batch node)
    local first=${CX_SET[0]} addr
    [[ $MASTER_ADDR_FROM == address ]] || { echo "$first"; return; }
    addr=$(getent hosts "$first" | awk '{print $1; exit}')
    echo "${addr:-$first}"
}

cx_halt_training() {
    CX_HALTED=1
    cx_at_risk halt
    cx_log "halt: the job ends in $((CX_HALT_AT + HALT_MARGIN - $(cx_now)))s; SIGTERM to the training step"
    "cx_${CX_SCHEDULER}_signal" "$CX_STEP_TRAIN" "$CX_TRAIN_PID" TERM
    if ! cx_wait_pid "$CX_TRAIN_PID" "$TRAIN_STOP_GRACE"; then
        cx_log "training still running after ${TRAIN_STOP_GRACE}s: SIGKILL"
        "cx_${CX_SCHEDULER}_signal" "$CX_STEP_TRAIN" "$CX_TRAIN_PID" KILL
        cx_wait_pid "$CX_TRAIN_PID" 30 || cx_kill_tree "$CX_TRAIN_PID"
    fi
}

# ---------------------------------------------------------------- recovery
cx_replace_lost() {     # lost or blamed nodes out, spares in; too few spares: shrink to
                        # MIN_NODES, else the job ends (cachex job replace decides)
    cx_virtual && return 0
    "cx_${CX_SCHEDULER}_alive" "${CX_SET[@]}" "${CX_SPARE[@]}" || cx_finish failed "$CX_JOB_ERR"
    cx_node_lines
    cx_job replace --nodes "${CX_SET[*]}" --spares "${CX_SPARE[*]}" --up "${CX_UP[*]}" \
        --bad "${CX_BAD[*]}" --min-nodes "$MIN_NODES" || cx_finish failed "$CX_JOB_ERR"
    cx_node_lines
}

cx_recover() {
    cx_step recover 1
    cx_log "recover: ${CX_ARGV[*]}"
    local rc=0
    timeout --kill-after=30 "$(cx_fit "$RECOVER_TIMEOUT" halt)" "${CX_ARGV[@]}" </dev/null || rc=$?
    ((rc == 0)) || cx_log "cachex recover ended with status $rc"
    return "$rc"
}

cx_blame() {        # the nodes the failed training step failed on: into CX_BAD, for good
    cx_virtual && return 0
    local h
    while read -r h; do
        [[ -n $h ]] || continue
        CX_BAD+=("$h")
        printf '%s\n' "$h" >>"$CX_RUNDIR/bad-nodes"
        cx_log "training failed on $h: left out of this job from now on ($CX_RUNDIR/bad-nodes)"
    done < <("$(cx_bin cachex)" job failed-nodes "$CX_RUNDIR/train.err" \
                 --hosts "$(cx_join , "${CX_SET[@]}")" 2>/dev/null || true)
}

cx_relaunch_prepare() {     # after a failed training step; sets CX_RESUME
    cx_at_risk relaunch
    cx_blame
    cx_replace_lost
    cx_agents_stop "$AGENT_STOP_TIMEOUT" || true
    cx_status
    if ((CX_ST_USABLE == 0)); then
        cx_log "no checkpoint of run $RUN_NAME captured yet: relaunching from the start"
        CX_RESUME=
    elif cx_recover; then
        CX_RESUME=resume
    else
        cx_finish failed "cachex recover failed after the training failure (its message is above)"
    fi
    CX_AGENT_RESTARTS=0
    cx_agents_start
    cx_agents_wait_ready
}

# ---------------------------------------------------------------- the end
cx_finish() {       # MODE [MESSAGE] (done | halt | failed): final drain, verdict, exit
    local mode=$1 rc=0
    cx_log "final drain: the newest checkpoint goes to the PFS (DRAIN_TIMEOUT=${DRAIN_TIMEOUT}s)"
    cx_agents_stop "$DRAIN_TIMEOUT" || rc=$?
    cx_status
    "$(cx_bin cachex)" ls --config "$CACHEX_CONFIG" 2>&1 | sed 's/^/    /' || true
    [[ $mode == failed ]] && cx_die "$2; newest checkpoint $CX_ST_NEWEST at level $CX_ST_LEVEL"
    if [[ $CX_ST_NEWEST != - && $CX_ST_LEVEL != flushed ]]; then
        cx_die "the newest checkpoint $CX_ST_NEWEST is at level $CX_ST_LEVEL, not flushed to the PFS"
    fi
    ((rc == 0)) || cx_die "the agent step ended with status $rc during the final drain"
    if [[ $mode == "done" ]]; then
        cx_log "training finished; newest checkpoint $CX_ST_NEWEST is on the PFS"
        exit 0
    fi
    cx_log "halted before the walltime; newest checkpoint $CX_ST_NEWEST is on the PFS; resubmit to continue (RESUME=auto)"
    exit "$HALT_EXIT"
}

cx_on_term() {      # SIGTERM to the batch shell (the job ends, scancel): the agents get
                    # theirs and drain what they can, within AGENT_STOP_TIMEOUT and the
                    # job's time, before cx_on_exit kills what is left
    cx_log "SIGTERM: the job is ending; the agents drain first"
    if cx_alive_pid "${CX_AGENTS_PID:-}"; then
        "cx_${CX_SCHEDULER}_signal" "$CX_STEP_AGENTS" "$CX_AGENTS_PID" TERM
        cx_wait_pid "$CX_AGENTS_PID" "$(cx_fit "$AGENT_STOP_TIMEOUT")" \
            || cx_log "the agents still run after ${AGENT_STOP_TIMEOUT}s: killing them"
    fi
    exit 143
}

cx_traps() {
    trap cx_on_warning USR1
    trap cx_on_exit EXIT
    trap cx_on_term TERM
}

cx_on_exit() {      # the batch shell ends: leave no launcher behind
    local pid
    for pid in $CX_TRAIN_PID $CX_AGENTS_PID; do
        cx_alive_pid "$pid" && cx_kill_tree "$pid"
    done
    return 0
}

# ---------------------------------------------------------------- plan (dry run)
cx_plan() {         # CX_PLAN=1: print every step's command line, launch nothing. The
                    # start (staging, directories, pre-flight, agents) goes through the
                    # code a job runs, so the plan shows the job's own order.
    cx_stage
    cx_agents_start
    local kind
    for kind in recover train train-resume stop; do
        case $kind in
            train-resume) cx_step train "$RANKS_PER_NODE" resume ;;
            train) cx_step train "$RANKS_PER_NODE" ;;
            stop) mapfile -t CX_ARGV < <(cx_cmd stop "$DRAIN_TIMEOUT") ;;
            *) cx_step "$kind" 1 ;;
        esac
        cx_exec "$kind"
    done
}

# ---------------------------------------------------------------- main
cx_main() {
    cx_check
    cx_load_modules
    cx_words CX_NODE_DIRS "$NODE_DIRS"
    cx_init_nodes
    cx_init_config
    if [[ $CX_PLAN == 1 ]]; then cx_plan; return 0; fi
    cx_init_halt
    cx_traps
    CX_AGENT_RESTARTS=0
    CX_RESUME=
    cx_stage
    cx_status
    if [[ $RESUME == yes ]] || [[ $RESUME == auto && $CX_ST_FLUSHED -gt 0 ]]; then
        cx_log "run $RUN_NAME has a checkpoint on the PFS: recovering it before training"
        cx_recover || cx_die "cachex recover failed at the start; RESUME=no starts over"
        CX_RESUME=resume
    fi
    cx_agents_start
    cx_agents_wait_ready
    local launches=0 rc
    while :; do
        cx_past_halt && cx_finish halt
        rc=0
        cx_train "$CX_RESUME" || rc=$?
        ((rc == 0)) && ((CX_HALTED == 0)) && cx_finish "done"
        ((CX_HALTED == 1)) && cx_finish halt
        cx_log "training step failed with status $rc (launch $((launches + 1)))"
        ((launches < MAX_RELAUNCHES)) \
            || cx_finish failed "training failed $((launches + 1)) times (MAX_RELAUNCHES=$MAX_RELAUNCHES)"
        cx_past_halt && cx_finish halt
        launches=$((launches + 1))
        cx_relaunch_prepare
    done
}

# ================================================================= Slurm
cx_slurm_hosts() { scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a Slurm job}"; }

cx_slurm_bad_at_start() { :; }     # Slurm starts no job on a node it knows is down

cx_slurm_alive() {  # HOST...: CX_JOB_OUT's `up` line: in the job and not down, drained
                    # or failing (cachex job up reads squeue and sinfo)
    local in_job
    in_job=$(squeue -h -j "$SLURM_JOB_ID" -o %N 2>/dev/null) || in_job=
    # Slurm's own tool expands its host list (names with several bracketed ranges too)
    [[ -z $in_job ]] || in_job=$(scontrol show hostnames "$in_job" 2>/dev/null | tr '\n' ' ')
    cx_job up slurm --hosts "$*" --in-job "$in_job" \
        < <(sinfo -h -N -n "$(cx_join , "$@")" -o '%N %T' 2>/dev/null || true)
}

cx_slurm_launcher() {   # NAME KIND PPN: CX_LAUNCH=(srun ...)
    local name=$1 kind=$2 ppn=$3 flags
    CX_LAUNCH=(srun --job-name="$name")
    [[ -z $SRUN_MPI ]] || CX_LAUNCH+=(--mpi="$SRUN_MPI")
    CX_LAUNCH+=(--kill-on-bad-exit=1)
    if [[ $kind == unpack ]]; then      # every host the job may use, spares too
        local -a all=("${CX_SET[@]}" "${CX_SPARE[@]}")
        CX_LAUNCH+=(--nodes="${#all[@]}" --ntasks-per-node=1 --overlap
                    --nodelist="$(cx_join , "${all[@]}")")
        return
    fi
    if cx_virtual; then
        # One slurmd: every virtual node's tasks on it; steps share its CPUs.
        CX_LAUNCH+=(--nodes=1 --ntasks=$((VNODES * ppn)) --overcommit --overlap)
    else
        CX_LAUNCH+=(--nodes="${#CX_SET[@]}" --ntasks-per-node="$ppn"
                    --nodelist="$(cx_join , "${CX_SET[@]}")")
        # The agents and recovery share the training nodes: they must not wait for CPUs.
        [[ $kind == train ]] || CX_LAUNCH+=(--overlap)
    fi
    if [[ $kind == train ]]; then flags=$SRUN_TRAIN_FLAGS; else flags=$SRUN_AGENT_FLAGS; fi
    local -a extra
    cx_words extra "$flags"
    CX_LAUNCH+=("${extra[@]}")
}

cx_slurm_broadcast() {  # CX_ARGV=(sbcast the packed venv to every node of the job)
    # -f: replace an older copy; -p: keep modes and times (the venv's scripts run)
    CX_ARGV=(sbcast -f -p "$(cx_stage_tar)" "$STAGE_DIR.tar")
}

cx_slurm_signal() {     # STEPNAME PID SIGNAL: to every task of the step(s) of that name
    local name=$1 pid=$2 sig=$3 id sent=0
    for id in $(squeue -h --steps -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null \
                | "$(cx_cachex)" job steps "$name"); do
        scancel --signal="$sig" "$id" 2>/dev/null && sent=1
    done
    ((sent)) || kill -"$sig" "$pid" 2>/dev/null || true
}

cx_slurm_left() {       # the job's seconds left (nothing when unlimited)
    squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null | "$(cx_cachex)" job left slurm
}

# ================================================================= PBS
# one line per rank: the package counts each host once
cx_pbs_hosts() { cat "${PBS_NODEFILE:?not inside a PBS job}"; }

# With tolerate_node_failures a job starts on nodes that already failed: ALCF's Aurora
# guide says to run `pbsnodes -l | grep <jobid>` as the job starts and keep those nodes
# out of mpiexec. Harmless without it (a node of the job is then never listed).
cx_pbs_bad_at_start() {
    local id=${PBS_JOBID%%.*}
    [[ $id =~ ^[0-9]+$ ]] || return 0
    pbsnodes -l 2>/dev/null | awk -v re="(^|[^0-9])$id([^0-9]|$)" '$0 ~ re {print $1}' \
        | tr '\n' ' '
    echo
}

cx_pbs_alive() {        # HOST...: CX_JOB_OUT's `up` line: not down or offline in
                        # pbsnodes (cachex job up reads each host's answer)
    cx_job up pbs --hosts "$*" \
        < <(for h in "$@"; do echo "# host $h"; pbsnodes -v "$h" 2>/dev/null; done)
}

cx_pbs_launcher() {     # NAME KIND PPN: CX_LAUNCH=(mpiexec ...)
    local name=$1 kind=$2 ppn=$3 n hostfile flags
    hostfile=$CX_RUNDIR/hosts
    cx_rundir
    printf '%s\n' "${CX_SET[@]}" >"$hostfile"
    n=$(($(cx_nodes) * ppn))
    if cx_virtual; then
        CX_LAUNCH=("$MPIEXEC" -n "$n")
        [[ $MPIEXEC_FLAVOR == openmpi ]] && CX_LAUNCH+=(--oversubscribe)
    else
        case $MPIEXEC_FLAVOR in
            hydra) CX_LAUNCH=("$MPIEXEC" -f "$hostfile" -n "$n" -ppn "$ppn") ;;
            pals) CX_LAUNCH=("$MPIEXEC" --hostfile "$hostfile" -n "$n" --ppn "$ppn") ;;
            openmpi) CX_LAUNCH=("$MPIEXEC" --hostfile "$hostfile" -n "$n" --map-by "ppr:$ppn:node") ;;
            *) cx_die "MPIEXEC_FLAVOR=$MPIEXEC_FLAVOR: expected hydra, pals or openmpi" 2 ;;
        esac
    fi
    : "$name"   # mpiexec has no step names: signals go to the launcher's process tree
    if [[ $kind == train ]]; then flags=$MPIEXEC_TRAIN_FLAGS; else flags=$MPIEXEC_AGENT_FLAGS; fi
    local -a extra
    cx_words extra "$flags"
    CX_LAUNCH+=("${extra[@]}")
}

cx_pbs_signal() {       # STEPNAME PID SIGNAL
    if [[ $3 == KILL ]]; then cx_kill_tree "$2"; else kill -"$3" "$2" 2>/dev/null || true; fi
}

cx_pbs_left() {         # the job's seconds left: its walltime less the walltime used
    qstat -f "$PBS_JOBID" 2>/dev/null | "$(cx_cachex)" job left pbs
}

# The job's own files (host file, the trainer's errors, bad nodes) beside the job's output
# in the directory it was submitted from (the PFS where sites ask for that, as Neuron's
# /scratch), not in the batch node's /tmp
: "${CX_RUNDIR:=$PWD/cachex-job-${SLURM_JOB_ID:-${PBS_JOBID:-$$}}}"
