#!/usr/bin/env bash
# CI legs on the other Pythons the package claims, each in a fresh clone of this checkout's HEAD
# with its own .venv, through the README's own scripts:
#   - Debian's system python3 (3.11.2 on this machine kind: the Python whose pickles differ) as
#     a non-root user: the demo, then the checkpoint save/load tests (TESTS);
#   - the lowest and the highest claimed Python (3.10, 3.13; pyenv's or on PATH): the same tests
#     and the async saves in flight at the interpreter's exit (EXIT_TESTS);
#   - torch-2.14.1: the second tested torch release (a ~5.5 GB CUDA build, run on the CPU) on
#     Python 3.11 (the only Python its wheel is on this machine for), installed by setup.sh
#     through DMUON_TORCH: every test module that touches torch internals (TORCH_TESTS).
# A Python that is not on the machine is reported and skipped; DMUON_REQUIRE_ALL_PYTHONS=1 makes
# that an error.
# Usage: scripts/ci-pythons.sh [prepare|run] [leg ...]
#   prepare  clone HEAD and install each leg's venv (downloads and unpacking: mostly waiting on
#            the network and the disk, so .ci/run does it while the main suite runs)
#   run      run each leg's tests in its prepared clone (preparing it first if it is not), then
#            remove the clone
#   (neither: run, which prepares as it goes)
# (legs: system, 3.10, 3.13, torch-2.14.1; default all). Prepared clones live under
# DMUON_LEGS_DIR (default /tmp/dmuon-ci-legs).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
mode=run
case "${1:-}" in prepare|run) mode=$1; shift ;; esac
legs=("$@")
[ ${#legs[@]} -gt 0 ] || legs=(system 3.10 3.13 torch-2.14.1)
legs_dir=${DMUON_LEGS_DIR:-/tmp/dmuon-ci-legs}

# What differs between Pythons: pickles (the metadata allow-list, the fixtures written on
# other Pythons), exceptions carried between ranks, the interpreter's exit with a save in
# flight; and the runtime and every save and load entry point once. On local disk (object
# stores: the main suite). Resume and the manager are the same code on every Python: the
# main suite runs them. So are the 4-rank and HSDP variants of the round trips (the 2-rank
# ones pickle, raise and exit alike): which mesh the shards lie on is torch's and dmuon's
# code, not the interpreter's, and the main suite and the torch leg run them. The runtime's
# uneven shapes once too: accumulation over 3 micro-batches with some matrices dedicated (one
# of them without a gradient every other step); the other five selections and accumulations
# are the same interpreter running other branches of dmuon's own code (the main suite and the
# torch leg run them all).
TESTS=(
    tests/core/test_state_dict.py tests/core/test_runtime_cases.py tests/core/test_compat.py
    tests/dcp/test_format_compat.py tests/dcp/test_fault_hostile.py
    tests/dcp/test_entry_points.py tests/dcp/test_async.py
)
# The exit cases (torchrun jobs, ~11 s each), on the Pythons whose interpreter exit is not the
# main suite's (3.10, 3.13; the system Python is a 3.11, as the main suite's is: the same
# threading and atexit shutdown, so that leg leaves them to the main suite): every ending of
# the interpreter (its return, an exception, SIGTERM), a committed save and a failed one. Left
# to the main suite and the torch leg: the "destroy" ending (the save finished by the
# destroy_process_group patch, then the interpreter returns with nothing in flight; the "raise"
# ending, which stays, goes through the same patch from its finally), the other entry points
# finished by that patch (which save is in flight, dmuon's manager or torch's own thread, is
# torch's and dmuon's code) and the failed save reported by that patch (an exception raised
# from destroy_process_group, as any; the failed save at the interpreter's exit stays here).
EXIT_TESTS=(
    tests/dcp/test_async_exit.py
    --deselect "tests/dcp/test_async_exit.py::test_a_save_in_flight_at_the_end_of_the_job_is_committed[destroy-local]"
    --deselect tests/dcp/test_async_exit.py::test_other_entry_points_are_finished_before_destroy
    --deselect "tests/dcp/test_async_exit.py::test_a_save_that_cannot_commit_is_reported_on_every_rank_and_fails_the_job[destroy]"
)
LEG_FILTER=(-k "not s3 and not rgw and not gcs and not 4ranks and not hsdp2x2 and not (on_4_ranks and not 3-some)")
# What a torch release's private names touch (dmuon/compat.py, fsdp_patch.py, exit_guard.py):
# every compat name, the runtime and its state-dict hooks (meta init, compile, tensor-parallel
# matrices, expert stacks on DTensor's private strided shards), the docs' examples, every entry
# point, async saves and their exit guard, torch's own readers and writers, resume, the
# fixtures, the plan cache, torchtitan's trainer. Not the pipeline and expert-parallel
# torchtitan runs (torch's public schedules, minutes each: the main suite), nor the object-store
# variants of the async-exit cases (the S3 client's threads at exit are the same code on any
# torch; the exit guard's torch hooks are met by the local-disk variants; the main suite runs
# them on S3), nor the parse of the docs' torchtitan config module (torchtitan's ConfigManager
# reading a Python module: config objects only, no model, tensor or process group; ~7 s).
# Of the local async-exit cases (torchrun jobs, ~11 s each), not the "raise" ending (its save is
# finished by the destroy_process_group of the job's finally, as in the "destroy" ending; what
# else it does, an exception ending the interpreter, is the Python legs') nor dmuon's manager
# finished by that patch (dmuon's async save, as in the "destroy" ending; torch's own async
# thread, the other entry point, stays). Nor the 4-rank variants of the resume round trips: the
# same 1-D mesh as the 2-rank ones, at another size (torch's FSDP2 sharding code alike); HSDP's
# 2-D mesh and the moves between world sizes (4 to 2, 2 to 4) stay.
TORCH_TESTS=(
    tests/core/test_compat.py tests/core/test_state_dict.py tests/core/test_runtime_cases.py
    tests/core/test_meta_init.py tests/core/test_compile.py tests/core/test_exit_guard_release.py
    tests/core/test_tensor_parallel.py tests/core/test_expert_stacks.py tests/core/test_docs_examples.py
    tests/dcp/test_entry_points.py tests/dcp/test_async.py tests/dcp/test_async_exit.py
    tests/dcp/test_torch_compat.py tests/dcp/test_resume.py tests/dcp/test_format_compat.py
    tests/dcp/test_plan_cache.py tests/integrations/test_torchtitan.py
    tests/integrations/test_torchtitan_trainer.py
    -k "not s3 and not rgw and not gcs and not 4ranks and not test_docs_config_parses_through_torchtitans_config_manager"
    --deselect "tests/dcp/test_async_exit.py::test_a_save_in_flight_at_the_end_of_the_job_is_committed[raise-local]"
    --deselect "tests/dcp/test_async_exit.py::test_other_entry_points_are_finished_before_destroy[manager]"
)
USER_NAME=dmuon-ci
clone=""  # the leg being run: its clone is removed when the leg ends, also when it fails
[ "$mode" = prepare ] || trap '[ -z "$clone" ] || rm -rf "$clone"' EXIT

find_python() {  # $1: "system", a version such as 3.10, or torch-X; prints nothing if none runs
    if [ "${1#torch-}" != "$1" ]; then
        find_python 3.11
        return 0
    fi
    if [ "$1" = system ]; then
        [ -x /usr/bin/python3 ] && echo /usr/bin/python3
        return 0
    fi
    local root candidate
    root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    # pyenv's own install first: its shims exist for every version but run only the selected one
    for candidate in $(find "$root/versions" -maxdepth 3 -path "*/versions/$1.*/bin/python$1" 2>/dev/null | sort -V -r) \
                     "$(command -v "python$1" 2>/dev/null || true)"; do
        if [ -n "$candidate" ] && "$candidate" -c "import sys" >/dev/null 2>&1; then
            echo "$candidate"
            return 0
        fi
    done
}

as_user() {  # run a command as the non-root user when we are root, else as ourselves
    if [ "$(id -u)" = 0 ]; then
        runuser -u "$USER_NAME" -- env HOME="/home/$USER_NAME" "$@"
    else
        "$@"
    fi
}

leg_env() {  # $1: leg name; the environment its set-up and tests run with
    case "$1" in
        system) echo "env -u DMUON_REQUIRE_ALL_STORES DMUON_SKIP_LINT=1 DMUON_PYTHON=$2" ;;
        torch-*) echo "env DMUON_TORCH=torch==${1#torch-} DMUON_PYTHON=$2" ;;
        *) echo "env DMUON_SKIP_LINT=1 DMUON_PYTHON=$2" ;;
    esac
}

prepare_leg() {  # $1: leg name; $2: its Python. Clone and install, once.
    local dir="$legs_dir/$1"
    [ -f "$dir/.prepared" ] && return 0
    rm -rf "$dir"
    mkdir -p "$dir"
    git clone -q "$repo" "$dir/dmuon"
    if [ "$1" = system ] && [ "$(id -u)" = 0 ]; then
        id "$USER_NAME" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$USER_NAME"
        chmod 755 "$legs_dir"
        chown -R "$USER_NAME:$USER_NAME" "$dir"
    fi
    # shellcheck disable=SC2046
    if [ "$1" = system ]; then
        as_user $(leg_env "$1" "$2") bash "$dir/dmuon/scripts/setup.sh" test
        as_user $(leg_env "$1" "$2") bash "$dir/dmuon/scripts/setup.sh"
    else
        $(leg_env "$1" "$2") bash "$dir/dmuon/scripts/setup.sh" test
    fi
    touch "$dir/.prepared"
}

run_leg() {  # $1: leg name
    local python
    python=$(find_python "$1")
    if [ -z "$python" ]; then
        echo "ci-pythons: no Python for leg '$1' on this machine" >&2
        [ "${DMUON_REQUIRE_ALL_PYTHONS:-0}" = 1 ] && return 1
        return 0
    fi
    if [ "$mode" = prepare ]; then
        echo "== preparing leg $1: $("$python" --version 2>&1) ($python)"
        prepare_leg "$1" "$python"
        return 0
    fi
    echo "== leg $1: $("$python" --version 2>&1) ($python)"
    clone="$legs_dir/$1"
    prepare_leg "$1" "$python"
    local src="$clone/dmuon"
    # shellcheck disable=SC2046
    if [ "$1" = system ]; then
        # DMUON_REQUIRE_ALL_STORES is left out: Ceph's packages need root, which this leg is not.
        as_user $(leg_env "$1" "$python") bash "$src/scripts/demo.sh" --steps 20 --save-every 5 --crash-at 12
        as_user $(leg_env "$1" "$python") bash "$src/scripts/test.sh" -p no:cacheprovider "${TESTS[@]}" "${LEG_FILTER[@]}"
    elif [ "${1#torch-}" != "$1" ]; then
        $(leg_env "$1" "$python") bash "$src/scripts/test.sh" -p no:cacheprovider "${TORCH_TESTS[@]}"
        "$src/.venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '${1#torch-}')" \
            || { echo "ci-pythons: leg $1 did not run on torch ${1#torch-}" >&2; return 1; }
    else
        $(leg_env "$1" "$python") bash "$src/scripts/test.sh" -p no:cacheprovider "${TESTS[@]}" "${EXIT_TESTS[@]}" \
            "${LEG_FILTER[@]}"
    fi
    rm -rf "$clone"
    clone=""
}

for leg in "${legs[@]}"; do
    run_leg "$leg"
done
