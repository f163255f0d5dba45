# shellcheck shell=bash
# cachex-job.sh: what a job template needs of a shell, shared by scripts/slurm/*.sbatch
# and scripts/pbs/*.pbs. A template sets its site variables (docs/jobs.md), sources this
# file and calls `cx_main`, which checks the variables, loads the modules, chooses the
# node set (`cachex job nodes`), writes the configuration, reads the time left, stages
# the environment (STAGE_VENV=1) and then hands the batch shell over to the supervisor,
# `cachex job run` (cachex_agent/job/supervisor.py): the agents, training, relaunches,
# lost nodes and spares, the halt before the walltime and the final drain are its, the
# decisions life.py's. This file keeps module loading, staging and each step's launch
# line (`cx_step`, which the supervisor calls back for the node set of the moment);
# it holds no loop and no decision. CX_PLAN=1 prints every step's command line instead.
#
# Exit status: 2 for a bad variable (one line); else the supervisor's.

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

: "${RESUME_ARGS=--resume}" "${RESUME:=auto}" "${HALT_MARGIN:=600}" "${HALT_EXIT:=0}"
: "${MAX_RELAUNCHES:=3}" "${MAX_AGENT_RESTARTS:=3}" "${TRAIN_STOP_GRACE:=60}" "${POLL:=2}"
: "${AGENT_START_TIMEOUT:=300}" "${AGENT_STOP_TIMEOUT:=120}" "${DRAIN_TIMEOUT:=900}"
: "${RECOVER_TIMEOUT:=1800}"

CX_LIB=${BASH_SOURCE[0]}
CX_LEFT=
CX_SET=()
CX_SPARE=()

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

cx_words() {        # NAME STRING: NAME=(words of STRING, shell quoting honoured)
    eval "$1=( $2 )"
}

cx_bin() { echo "$CX_BIN/$1"; }

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

cx_node_lines() {   # CX_JOB_OUT's `nodes`, `spares` and `note` lines: CX_SET, CX_SPARE,
                    # the log
    local key rest
    while read -r key rest; do
        case $key in
            nodes) read -r -a CX_SET <<<"$rest" ;;
            spares) read -r -a CX_SPARE <<<"$rest" ;;
            note) cx_log "$rest" ;;
        esac
    done <<<"$CX_JOB_OUT"
}

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

cx_init_left() {    # CX_LEFT: the job's seconds left as the scheduler states it (JOB_END,
                    # epoch seconds on this host's clock, overrides); empty: no limit known
    local left
    if [[ -n ${JOB_END:-} ]]; then
        [[ $JOB_END =~ ^[0-9]+$ ]] || cx_die "JOB_END=$JOB_END: expected epoch seconds" 2
        left=$((JOB_END - $(cx_now)))
    else
        left=$("cx_${CX_SCHEDULER}_left" 2>/dev/null || true)
    fi
    if [[ ! $left =~ ^-?[0-9]+$ ]]; then
        cx_log "no job end time known: no halt before the walltime"
        return
    fi
    ((left > HALT_MARGIN)) \
        || cx_die "HALT_MARGIN=${HALT_MARGIN}s leaves no time to train: the job ends in ${left}s" 2
    CX_LEFT=$left
    cx_log "job ends in ${left}s; halt ${HALT_MARGIN}s before (HALT_MARGIN)"
}

# ---------------------------------------------------------------- launch lines
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

cx_master_addr() {  # the first training node (rank 0) by name, or by its address where
                    # the site asks for one (Frontier: `hostname -i`, here resolved for
                    # that node, which need not be the batch node)
    local first=${CX_SET[0]} addr
    [[ $MASTER_ADDR_FROM == address ]] || { echo "$first"; return; }
    addr=$(getent hosts "$first" | awk '{print $1; exit}')
    echo "${addr:-$first}"
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

# ---------------------------------------------------------------- plan and hand-over
cx_plan() {         # CX_PLAN=1: every step's command line, in the order the job runs them
    cx_stage
    local kind
    for kind in prepare check agents recover train train-resume stop; do
        case $kind in
            prepare) ((${#CX_NODE_DIRS[@]})) || continue; cx_step prepare 1 ;;
            train-resume) cx_step train "$RANKS_PER_NODE" resume ;;
            train) cx_step train "$RANKS_PER_NODE" ;;
            stop) mapfile -t CX_ARGV < <(cx_cmd stop "$DRAIN_TIMEOUT") ;;
            *) cx_step "$kind" 1 ;;
        esac
        cx_exec "$kind"
    done
}

cx_save_vars() {    # the batch shell's variables, for the supervisor's call-backs (cx_step)
    local v line
    for v in $(compgen -v); do
        case $v in
            BASH* | COMP* | DIRSTACK | EPOCH* | FUNCNAME | GROUPS | HIST* | LINENO | OPT* | \
                PIPESTATUS | PPID | PWD | OLDPWD | RANDOM | SECONDS | SRANDOM | SHELLOPTS | \
                SHLVL | UID | EUID | _) continue ;;
        esac
        line=$(declare -p "$v" 2>/dev/null) || continue
        [[ ${line#declare -} =~ ^[a-zA-Z-]*r ]] || printf '%s\n' "$line"
    done >"$CX_RUNDIR/vars"
}

cx_handover() {     # the batch shell becomes the supervisor (the scheduler's signals too)
    cx_save_vars
    local -a opts=(--scheduler "$CX_SCHEDULER" --job-id "$(cx_job_id)" --lib "$CX_LIB"
        --rundir "$CX_RUNDIR" --cachex "$(cx_bin cachex)" --config "$CACHEX_CONFIG"
        --run-name "$RUN_NAME" --nodes "${CX_SET[*]}" --spares "${CX_SPARE[*]}"
        --vnodes "${VNODES:-0}" --min-nodes "$MIN_NODES" --ranks-per-node "$RANKS_PER_NODE"
        --resume "$RESUME" --max-relaunches "$MAX_RELAUNCHES"
        --max-agent-restarts "$MAX_AGENT_RESTARTS" --halt-margin "$HALT_MARGIN"
        --halt-exit "$HALT_EXIT" --train-stop-grace "$TRAIN_STOP_GRACE"
        --agent-start-timeout "$AGENT_START_TIMEOUT" --agent-stop-timeout "$AGENT_STOP_TIMEOUT"
        --drain-timeout "$DRAIN_TIMEOUT" --recover-timeout "$RECOVER_TIMEOUT" --poll "$POLL")
    [[ -z $CX_LEFT ]] || opts+=(--time-left "$CX_LEFT")
    exec "$(cx_bin cachex)" job run "${opts[@]}"
}

cx_main() {
    cx_check
    cx_load_modules
    cx_words CX_NODE_DIRS "$NODE_DIRS"
    cx_rundir
    cx_init_nodes
    cx_init_config
    if [[ $CX_PLAN == 1 ]]; then cx_plan; return 0; fi
    cx_init_left
    cx_stage
    cx_handover
}

# ================================================================= Slurm
cx_slurm_hosts() { scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a Slurm job}"; }

cx_slurm_bad_at_start() { :; }     # Slurm starts no job on a node it knows is down

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

cx_pbs_left() {         # the job's seconds left: its walltime less the walltime used
    qstat -f "$PBS_JOBID" 2>/dev/null | "$(cx_cachex)" job left pbs
}

# The job's own files (host file, the trainer's errors, bad nodes) beside the job's output
# in the directory it was submitted from (the PFS where sites ask for that, as Neuron's
# /scratch), not in the batch node's /tmp
: "${CX_RUNDIR:=$PWD/cachex-job-${SLURM_JOB_ID:-${PBS_JOBID:-$$}}}"
