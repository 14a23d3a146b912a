#!/usr/bin/env bash
# The prepared GPU check of hf_dspark (issue 14): one call on a machine lent through the `device` tool, after
# `bash benchmarks/gpu/prepare.sh` here (it prints the exact call). On the GPU machine, from the repository root:
#
#     bash benchmarks/gpu/check.sh [--budget SECONDS] [--parts tests,costs,rounds,train]
#
# installs the carried transformers wheel (.gpu-carry/wheels) beside the machine's packages, then, each part under
# its own time limit inside --budget (default 500 s), runs: the lossless tests on CUDA (pytest -k cuda), the
# verification cost curve, the per-round time split at R = 1, 8, 64 under a forced acceptance, and the trainer's
# throughput. Results go to $OUT: results.json, results.md, check.log, tests.log (README.md says how they come back).
#
#     bash benchmarks/gpu/check.sh --cpu-smoke
#
# runs the same code here on a tiny Qwen3-shaped target on the CPU (results in .gpu-carry/smoke-out unless $OUT is set).
set -uo pipefail

MODE=gpu
BUDGET=
PARTS=tests,costs,rounds,train
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-smoke) MODE=cpu-smoke ;;
        --budget) BUDGET=${2:?--budget needs a number of seconds}; shift ;;
        --parts) PARTS=${2:?--parts needs a comma-separated list of tests,costs,rounds,train}; shift ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "check.sh: unknown option '$1' (options: --cpu-smoke, --budget SECONDS, --parts LIST)" >&2; exit 2 ;;
    esac
    shift
done
for part in ${PARTS//,/ }; do
    case "$part" in tests|costs|rounds|train) ;; *) echo "check.sh: unknown part '$part' in --parts (tests, costs, rounds, train)" >&2; exit 2 ;; esac
done
if [ "$MODE" = gpu ]; then BUDGET=${BUDGET:-500}; PROFILE=gpu; else BUDGET=${BUDGET:-170}; PROFILE=cpu-smoke; fi

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1  # the repository root
PYTHON=${PYTHON:-python3}
CARRY=.gpu-carry
if [ -z "${OUT:-}" ]; then
    if [ "$MODE" = gpu ]; then
        echo "check.sh: \$OUT is not set. The device tool sets it on the GPU machine; without a GPU run --cpu-smoke." >&2
        exit 2
    fi
    OUT=$CARRY/smoke-out
    rm -rf "$OUT"
fi
mkdir -p "$OUT"
COMMAND="bash benchmarks/gpu/check.sh$( [ "$MODE" = cpu-smoke ] && echo ' --cpu-smoke') --budget $BUDGET --parts $PARTS"

# Shares of the budget per part; a part that finishes early leaves its time to the later ones.
declare -A SHARE=([tests]=28 [costs]=18 [rounds]=46 [train]=8)
RESERVE=15  # seconds kept for the report at the end

elapsed() { echo $((SECONDS - STARTED)); }

run_part() {  # run_part NAME COMMAND...: the command under the part's time limit (output to $PART_LOG if set, else
    # here); its status goes to results.json and its exit status to $PART_RC.
    local name=$1; shift
    local remaining=$((BUDGET - RESERVE - $(elapsed)))
    local shares=0 part
    for part in ${PARTS_LEFT}; do shares=$((shares + SHARE[$part])); done
    local limit=$((remaining * SHARE[$name] / shares))
    PARTS_LEFT=${PARTS_LEFT/$name/}
    if [ "$limit" -lt 10 ]; then
        echo "== $name: skipped, $remaining s of the budget left"
        "$PYTHON" benchmarks/gpu/check.py mark --results "$OUT" --part-name "$name" --rc 125 --seconds 0 --limit "$limit"
        PART_RC=125
        return
    fi
    echo "== $name (limit ${limit} s, $(elapsed) s into the check)"
    local begun=$SECONDS rc
    # timeout signals the whole process group (pytest-xdist workers too); SIGKILL 10 s later if still running.
    # PART_LIMIT lets check.py stop between measurements a little before that.
    if [ -n "${PART_LOG:-}" ]; then
        PART_LIMIT=$limit timeout --kill-after=10 "$limit" "$@" >"$PART_LOG" 2>&1
    else
        PART_LIMIT=$limit timeout --kill-after=10 "$limit" "$@"
    fi
    rc=$?
    PART_RC=$rc
    local took=$((SECONDS - begun))
    echo "== $name: exit $rc after $took s"
    "$PYTHON" benchmarks/gpu/check.py mark --results "$OUT" --part-name "$name" --rc "$rc" --seconds "$took" \
        --limit "$limit"
}

install_carried_wheels() {
    local wheels=$CARRY/wheels
    if ! ls "$wheels"/transformers-*.whl >/dev/null 2>&1; then
        echo "check.sh: no transformers wheel in $wheels. Run 'bash benchmarks/gpu/prepare.sh' on the development" \
             "machine and name .gpu-carry/wheels and .gpu-carry/configs in the run call's carry list." >&2
        return 1
    fi
    # Installed into a folder of its own, first on PYTHONPATH: the machine's own packages stay as they are (and a
    # smoke run here does not touch this machine's environment either).
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/hf-dspark-site.XXXXXX")
    local install=("$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE")
    "${install[@]}" "$wheels"/transformers-*.whl || return 1
    # transformers 5.24 needs huggingface_hub >= 1.31 (5.17, the machine's own, needs >= 1.5): install the carried
    # one only when the machine's is older, since a newer one is what 5.24 was released against.
    if ! "$PYTHON" - <<'EOF'
import importlib.metadata, sys
try:
    version = tuple(int(p) for p in importlib.metadata.version("huggingface_hub").split(".")[:2])
except importlib.metadata.PackageNotFoundError:
    version = (0, 0)
sys.exit(0 if version >= (1, 31) else 1)
EOF
    then
        if ! ls "$wheels"/huggingface_hub-*.whl >/dev/null 2>&1; then
            echo "check.sh: this machine's huggingface_hub is older than 1.31 and none was carried" \
                 "(prepare.sh leaves it out when the call would pass 64 MiB); carry huggingface_hub>=1.31." >&2
            return 1
        fi
        "${install[@]}" "$wheels"/huggingface_hub-*.whl || return 1
    fi
    # The repository itself is imported from here (what `pip install --no-deps -e .` gives, without a build step).
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    "$PYTHON" - <<'EOF' || return 1
import sys
import transformers
import hf_dspark
print(f"transformers {transformers.__version__} from {transformers.__file__}; hf_dspark from {hf_dspark.__file__}")
if transformers.__version__ != "5.24.0":
    sys.exit(f"check.sh: transformers {transformers.__version__} was imported, not the carried 5.24.0")
EOF
    # The trainer imports accelerate and, where installed, peft, which imports some model classes at module level;
    # a family the trimmed wheel lacks shows here (add it to KEEP_MODELS in prepare.sh). Only the train part needs it.
    "$PYTHON" -c "from transformers import Trainer" \
        || echo "check.sh: WARNING: 'from transformers import Trainer' failed (above); the train part will fail too"
}

main() {
    STARTED=$SECONDS
    trap '[ -n "${SITE:-}" ] && rm -rf "$SITE"' EXIT  # the installed wheels are the check's alone
    PARTS_LEFT=" ${PARTS//,/ } "
    echo "== hf_dspark GPU check: profile $PROFILE, budget $BUDGET s, parts $PARTS, results in $OUT"
    if [ "$MODE" = cpu-smoke ]; then
        export OMP_NUM_THREADS=1  # the development machine is shared: one thread per torch process
    elif command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
    fi
    export PYTHONUNBUFFERED=1
    install_carried_wheels || { echo "check.sh: the carried packages did not install; nothing was measured." >&2; return 1; }
    if [ ! -f "$CARRY/configs/qwen3-8b/config.json" ]; then
        echo "== no carried configs: writing them from the published shapes in check.py"
        "$PYTHON" benchmarks/gpu/check.py configs --output "$CARRY/configs" || return 1
    fi
    "$PYTHON" benchmarks/gpu/check.py environment --results "$OUT" --profile "$PROFILE" --command "$COMMAND" || return 1

    local part
    for part in ${PARTS//,/ }; do
        case "$part" in
            tests)
                # Every test that runs on CUDA: the device-parametrised lossless and batched sliding-window tests, and the
                # GPU-only ones (a drafter following a GPU target, a target split over devices, flash attention).
                local tests=(-v -rs -p no:cacheprovider -k "cuda or gpu_target or split_over_devices or flash_attention"
                             tests/lossless/test_greedy_identity.py tests/lossless/test_sampling_lossless.py tests/engine/test_batched_sliding_window.py
                             tests/lossless/test_devices.py tests/layouts/test_bad_input.py tests/engine/test_batched_attention_kinds.py)
                # The tests are tiny and bound by kernel launches: several workers share the GPU (pytest-xdist is
                # on the GPU image); each runs torch on one thread.
                local workers=()
                if [ "$MODE" = gpu ] && "$PYTHON" -c "import xdist" 2>/dev/null; then workers=(-n 6); fi
                PART_LOG=$OUT/tests.log run_part tests env OMP_NUM_THREADS=1 "$PYTHON" -m pytest "${tests[@]}" ${workers[@]+"${workers[@]}"}
                if [ ${#workers[@]} -gt 0 ] && [ "$PART_RC" -gt 1 ] && [ "$PART_RC" -ne 124 ] && [ "$PART_RC" -ne 137 ] \
                    && ! grep -qE "PASSED|FAILED" "$OUT/tests.log"; then
                    # pytest-xdist did not get the tests going (a plugin clash, say): its log stays, then one worker.
                    echo "== pytest with ${workers[*]} ran no test (exit $PART_RC, tests-xdist.log); again in one process"
                    mv "$OUT/tests.log" "$OUT/tests-xdist.log"
                    PARTS_LEFT=" tests$PARTS_LEFT"
                    PART_LOG=$OUT/tests.log run_part tests env OMP_NUM_THREADS=1 "$PYTHON" -m pytest "${tests[@]}"
                fi
                tail -n 8 "$OUT/tests.log"
                "$PYTHON" benchmarks/gpu/check.py tests-summary --results "$OUT" --log "$OUT/tests.log" --rc "$PART_RC"
                ;;
            *)
                run_part "$part" "$PYTHON" benchmarks/gpu/check.py "$part" --results "$OUT" --profile "$PROFILE" \
                    --configs "$CARRY/configs"
                ;;
        esac
    done
    "$PYTHON" benchmarks/gpu/check.py report --results "$OUT"
    echo "== done in $(elapsed) s; results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
}

main 2>&1 | tee -a "$OUT/check.log"
exit "${PIPESTATUS[0]}"
