# shellcheck shell=bash
# cachex-job.sh: what a job template needs of a shell, shared by scripts/slurm/*.sbatch
# and scripts/pbs/*.pbs. A template sets its site variables (docs/jobs.md), sources this
# file and calls `cx_main`, which loads the modules into the batch shell (its steps
# inherit them), saves the shell's variables and hands the batch shell over to
# `cachex job run` (cachex_agent/job/start.py, supervisor.py): the checks of the
# variables, the node set, the configuration, the time left, the order of staging, the
# agents, training, relaunches, lost nodes and spares, the halt before the walltime and
# the final drain are the package's. This file keeps module loading and each step's
# launch line (`cx_step`, which the package calls back with the node set of the moment
# and the values it settled); it holds no loop and no decision. CX_PLAN=1 prints every
# step's command line instead.
#
# Exit status: 2 for a bad variable (one line); else the package's.

CX_LIB=${BASH_SOURCE[0]}
declare -A CX_STEP_NAME=([agents]=cachex-agents [check]=cachex-agents [recover]=cachex-recover
                         [prepare]=cachex-prepare [train]=train [unpack]=cachex-stage)
# On every node: the broadcast tar becomes STAGE_DIR whole (unpacked aside, then renamed);
# a directory there that is not an earlier staged copy is never removed.
# shellcheck disable=SC2016  # expanded by the node's bash, $1 = STAGE_DIR
CX_UNPACK='set -e; d=$1; rm -rf "$d.new"; mkdir -p "$d.new"; tar -xf "$d.tar" -C "$d.new"; rm -f "$d.tar"; touch "$d.new/.cachex-staged"; if [ -e "$d" ]; then [ -f "$d/.cachex-staged" ] || { echo "cachex-unpack: $d exists and is no staged venv: not replaced" >&2; exit 1; }; rm -rf "$d"; fi; mv "$d.new" "$d"'
: "${SRUN_MPI=pmi2}"            # empty: no --mpi, the site's default plugin
: "${RESUME_ARGS=--resume}"
: "${MPIEXEC:=mpiexec}"

# ---------------------------------------------------------------- helpers
cx_log() { printf '%s cachex-job: %s\n' "$(date +%H:%M:%S)" "$*"; }

cx_die() {      # MESSAGE [STATUS]: one line on stderr, then exit
    printf '%s cachex-job: error: %s\n' "$(date +%H:%M:%S)" "$1" >&2
    exit "${2:-1}"
}

cx_join() { local IFS=$1; shift; echo "$*"; }

cx_words() {        # NAME STRING: NAME=(words of STRING, shell quoting honoured)
    eval "$1=( $2 )"
}

cx_flags() {        # KIND: the launcher's flags of that step, train's or the agents'
    local -a words
    if [[ $1 == train ]]; then cx_words words "$2"; else cx_words words "$3"; fi
    CX_LAUNCH+=("${words[@]}")
}

cx_cachex() {       # the cachex of the venv; in a plan (CX_PLAN=1, no venv yet) PATH's
    if [[ -x $CX_BIN/cachex || ${CX_PLAN:-0} != 1 ]]; then echo "$CX_BIN/cachex"; else echo cachex; fi
}

# ---------------------------------------------------------------- modules
cx_load_modules() {     # MODULE_USE, MODULES: `module use` the directories, `module load`
                        # the modules in this shell, whose steps inherit it
    [[ -n ${MODULES:-} ]] || return 0
    local -a mods dirs
    cx_words mods "$MODULES"
    cx_words dirs "${MODULE_USE:-}"
    type module >/dev/null 2>&1 \
        || cx_die "MODULES=$MODULES but this shell has no \`module\` command (source the site's module init first, or set MODULES=)" 2
    local rc=0 dir purge=${MODULE_PURGE:-0}
    set +eu     # module functions (Lmod, Environment Modules) are not written for -eu
    # a purge first where the site's examples do (Neuron): the batch shell inherits the
    # login node's modules, which may not be the ones the venv was built under
    if [[ $purge == 1 ]]; then module purge || rc=$?; fi
    for dir in "${dirs[@]}"; do
        module use "$dir" || rc=$?
    done
    if ((rc == 0)); then
        module load "${mods[@]}"
        rc=$?
    fi
    set -eu
    ((rc == 0)) || cx_die "module use ${dirs[*]} / load ${mods[*]} failed with status $rc (MODULE_USE, MODULES)" 2
    if [[ ${CRAY_LD_FIRST:-0} == 1 ]]; then     # a non-default Cray PE: its libraries first
        export LD_LIBRARY_PATH=${CRAY_LD_LIBRARY_PATH:-}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
    cx_log "modules: $([[ $purge == 1 ]] && echo 'purge; ')${dirs[*]:+use ${dirs[*]}; }${mods[*]}"
}

# ---------------------------------------------------------------- launch lines
# The commands each step runs, whatever the launcher (the same under Slurm and PBS).
cx_cmd() {          # KIND [resume|load]: prints the command, one word per line
    case $1 in
        agents) cx_node_bin cachex-agent; printf '%s\n' --config "$CACHEX_CONFIG" ;;
        check) cx_node_bin cachex-agent; printf '%s\n' --config "$CACHEX_CONFIG" --check ;;
        recover) cx_node_bin cachex; printf '%s\n' recover --config "$CACHEX_CONFIG" ;;
        unpack) printf '%s\n' bash -c "$CX_UNPACK" cachex-unpack "$STAGE_DIR" ;;
        # -f: replace an older copy; -p: keep modes and times (the venv's scripts run)
        stage) printf '%s\n' sbcast -f -p "$STAGE_TAR" "$STAGE_DIR.tar" ;;
        prepare)
            local -a dirs
            cx_words dirs "$NODE_DIRS"
            printf '%s\n' mkdir -p "${dirs[@]}"
            ;;
        train)
            local -a words resume=()
            cx_words words "$TRAIN_CMD"
            [[ ${2:-} == resume ]] && cx_words resume "$RESUME_ARGS"
            [[ ${2:-} == load ]] && cx_words resume "$RESUME_ARGS ${LOAD_FROM_ARGS:-}"
            printf '%s\n' "${words[@]}" "${resume[@]}"
            ;;
    esac
}

cx_node_bin() {     # NAME: how a node step runs a cachex program, one word a line:
                    # from the staged copy (its own python: the entry script's #! names
                    # the shared venv) or from CX_BIN
    if [[ $STAGE_VENV == 1 ]]; then
        printf '%s\n' "$STAGE_DIR/bin/python" "$STAGE_DIR/bin/$1"
    else
        printf '%s\n' "$CX_BIN/$1"
    fi
}

cx_step() {         # KIND PPN [ARG]: CX_ARGV=(launcher + command) of a step; the stage
                    # step (sbcast) has no launcher
    local kind=$1 ppn=$2
    local -a cmd
    mapfile -t cmd < <(cx_cmd "$kind" "${3:-}")
    CX_LAUNCH=()
    if [[ $kind != stage ]]; then
        "cx_${CX_SCHEDULER}_launcher" "${CX_STEP_NAME[$kind]}" "$kind" "$ppn"
        cx_step_env "$kind"
    fi
    # shellcheck disable=SC2034  # read by the package's call-back (job/shell.py)
    CX_ARGV=("${CX_LAUNCH[@]}" "${cmd[@]}")
}

cx_step_env() {     # KIND: TRAIN_ENV for the training step only; AGENT_ENV_UNSET out of
                    # every other step (on Frontier: MPICH_GPU_SUPPORT_ENABLED, with which
                    # Cray MPICH exits unless the GTL library is linked; the agents' buffers
                    # are host memory)
    local -a pre=(env) words=()
    local var
    if [[ $1 == train ]]; then
        cx_words words "${TRAIN_ENV:-}"
        pre+=("${words[@]}")
    else
        for var in ${AGENT_ENV_UNSET:-}; do pre+=(-u "$var"); done
    fi
    ((${#pre[@]} == 1)) || CX_LAUNCH=("${pre[@]}" "${CX_LAUNCH[@]}")
}

# ---------------------------------------------------------------- hand-over
cx_save_vars() {    # the batch shell's variables, for the package (read and call-backs)
    local -a names
    mapfile -t names < <(compgen -v | grep -Ev '^(BASH.*|COMP.*|DIRSTACK|EPOCH.*|FUNCNAME|GROUPS|HIST.*|LINENO|OPT.*|PIPESTATUS|PPID|PWD|OLDPWD|RANDOM|SECONDS|SRANDOM|SHELLOPTS|SHLVL|UID|EUID|_)$')
    # a readonly one cannot be set again where the file is read
    { declare -p "${names[@]}" 2>/dev/null || true; } | grep -v '^declare -[a-zA-Z]*r' >"$CX_RUNDIR/vars"
}

cx_main() {
    [[ -n ${CX_BIN:-} ]] || cx_die "CX_BIN is not set (see the variables at the top of the template)" 2
    [[ ${CX_PLAN:-0} == 1 || -x $CX_BIN/cachex-agent ]] \
        || cx_die "CX_BIN=$CX_BIN: no cachex-agent there (make venv, or pip install cachex-agent)" 2
    cx_load_modules
    mkdir -p "$CX_RUNDIR" && chmod 700 "$CX_RUNDIR"     # private: host lists, errors
    cx_save_vars
    # the batch shell becomes the package's supervisor (the scheduler's signals too)
    exec "$(cx_cachex)" job run --lib "$CX_LIB" --vars "$CX_RUNDIR/vars"
}

# ================================================================= Slurm
cx_slurm_launcher() {   # NAME KIND PPN: CX_LAUNCH=(srun ...)
    local name=$1 kind=$2 ppn=$3
    CX_LAUNCH=(srun --job-name="$name")
    [[ -z $SRUN_MPI ]] || CX_LAUNCH+=(--mpi="$SRUN_MPI")
    CX_LAUNCH+=(--kill-on-bad-exit=1)
    if [[ $kind == unpack ]]; then      # every host the job may use, spares too
        local -a all=("${CX_SET[@]}" "${CX_SPARE[@]}")
        CX_LAUNCH+=(--nodes="${#all[@]}" --ntasks-per-node=1 --overlap
                    --nodelist="$(cx_join , "${all[@]}")")
        return
    fi
    if [[ -n ${VNODES:-} ]]; then
        # One slurmd: every virtual node's tasks on it; steps share its CPUs.
        CX_LAUNCH+=(--nodes=1 --ntasks=$((VNODES * ppn)) --overcommit --overlap)
    else
        CX_LAUNCH+=(--nodes="${#CX_SET[@]}" --ntasks-per-node="$ppn"
                    --nodelist="$(cx_join , "${CX_SET[@]}")")
        # The agents and recovery share the training nodes: they must not wait for CPUs.
        [[ $kind == train ]] || CX_LAUNCH+=(--overlap)
    fi
    cx_flags "$kind" "${SRUN_TRAIN_FLAGS:-}" "${SRUN_AGENT_FLAGS:-}"
}

# ================================================================= PBS
cx_pbs_launcher() {     # NAME KIND PPN: CX_LAUNCH=(mpiexec ...); mpiexec has no step
                        # names: signals go to the launcher's process tree
    local kind=$2 ppn=$3 hostfile=$CX_RUNDIR/hosts n
    printf '%s\n' "${CX_SET[@]}" >"$hostfile"
    n=$((${VNODES:-${#CX_SET[@]}} * ppn))
    if [[ -n ${VNODES:-} ]]; then
        CX_LAUNCH=("$MPIEXEC" -n "$n")
        [[ $MPIEXEC_FLAVOR == openmpi ]] && CX_LAUNCH+=(--oversubscribe)
    else
        case $MPIEXEC_FLAVOR in
            hydra) CX_LAUNCH=("$MPIEXEC" -f "$hostfile" -n "$n" -ppn "$ppn") ;;
            pals) CX_LAUNCH=("$MPIEXEC" --hostfile "$hostfile" -n "$n" --ppn "$ppn") ;;
            openmpi) CX_LAUNCH=("$MPIEXEC" --hostfile "$hostfile" -n "$n" --map-by "ppr:$ppn:node") ;;
        esac
    fi
    cx_flags "$kind" "${MPIEXEC_TRAIN_FLAGS:-}" "${MPIEXEC_AGENT_FLAGS:-}"
}

# The job's own files (host file, the trainer's errors, bad nodes) beside the job's output
# in the directory it was submitted from (the PFS where sites ask for that, as Neuron's
# /scratch), not in the batch node's /tmp
: "${CX_RUNDIR:=$PWD/cachex-job-${SLURM_JOB_ID:-${PBS_JOBID:-$$}}}"
