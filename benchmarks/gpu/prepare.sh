#!/usr/bin/env bash
# Prepare the GPU check (check.sh) on the development machine, which has the network; the GPU machine has none.
#
#     bash benchmarks/gpu/prepare.sh
#
# writes into .gpu-carry/ (ignored by git, carried by the `run` call):
#   wheels/   transformers 5.24.0 (the GPU image has 5.17), trimmed to the model families the check loads
#             (trim_wheel.py says why), and huggingface_hub 1.33.0 for a machine whose own is older than 5.24
#             needs (>= 1.31; 5.17 needs only >= 1.5), when it fits the call's 64 MiB
#   configs/  Qwen3-8B, Qwen3-1.7B and the smoke test's tiny target as Qwen3Config JSON, from the published
#             shapes in check.py (no weights: the check builds random ones of these shapes on the GPU)
# then checks that the working tree plus these fits the 64 MiB a call carries, and prints the call.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."  # the repository root
PYTHON=${PYTHON:-python3}
CARRY=.gpu-carry
TRANSFORMERS_VERSION=5.24.0
HUB_VERSION=1.33.0  # the version seen on the GPU image (KINDS.md of the device tool), >= the 1.31 that 5.24 needs
# Families the check imports: the tests' targets (llama, qwen3, gemma3 and the sliding-window, hybrid and MLA ones the
# CUDA tests import), the auto classes, the siblings those import
# (trim_wheel.py adds them), and those that accelerate / peft import at module level (peft: Bloom, GPT-2's Conv1D).
KEEP_MODELS="auto llama qwen3 gemma3 qwen2 mistral gemma bloom gpt2 lfm2 qwen3_5 gemma4 deepseek_v3 gemma2 llama4 qwen3_next"
CALL_LIMIT=$((64 * 1024 * 1024))
MARGIN=$((1024 * 1024))  # room for files that appear before the call (the regeneration job's shards, results)

mkdir -p "$CARRY/downloads"
rm -rf "$CARRY/wheels" "$CARRY/configs"
echo "== downloading transformers $TRANSFORMERS_VERSION and huggingface_hub $HUB_VERSION (pure-Python wheels)"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --dest "$CARRY/downloads" "transformers==$TRANSFORMERS_VERSION" "huggingface_hub==$HUB_VERSION"
"$PYTHON" benchmarks/gpu/trim_wheel.py "$CARRY/downloads/transformers-$TRANSFORMERS_VERSION-py3-none-any.whl" \
    --keep $KEEP_MODELS --output "$CARRY/wheels"
"$PYTHON" benchmarks/gpu/check.py configs --output "$CARRY/configs"

bytes() { du -cb "$@" 2>/dev/null | tail -n 1 | cut -f 1; }
# What the call carries besides the carry list: tracked files and untracked ones git does not ignore.
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f 1)
carried=$(bytes "$CARRY/wheels" "$CARRY/configs")
hub_wheel=$(ls "$CARRY/downloads"/huggingface_hub-"$HUB_VERSION"-*.whl)
hub=$(bytes "$hub_wheel")
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
if [ $((tree + carried + hub + MARGIN)) -le "$CALL_LIMIT" ]; then
    cp "$hub_wheel" "$CARRY/wheels/"
    carried=$((carried + hub))
else
    echo "== huggingface_hub left out: it would take the call past 64 MiB (check.sh needs it only on a machine whose" \
         "own huggingface_hub is older than 1.31; the GPU image was seen with 1.33.0)"
fi
total=$((tree + carried))
echo "== the call carries $(mib "$tree") of working tree + $(mib "$carried") from $CARRY = $(mib "$total") of 64 MiB"
if [ "$total" -gt "$CALL_LIMIT" ]; then
    echo "prepare.sh: that is over the 64 MiB a call may carry. The largest travelling files:" >&2
    git ls-files -z --cached --others --exclude-standard | du -b --files0-from=- 2>/dev/null | sort -n | tail -n 10 >&2
    echo "Make the tree smaller (commit big untracked outputs compressed, or ignore them) and run prepare.sh again." >&2
    exit 1
fi
ls -l "$CARRY/wheels"
cat <<EOF

== ready. The GPU check is one call of the device tool's run (README.md beside this script):

    run(command="bash benchmarks/gpu/check.sh", carry=[".gpu-carry/wheels", ".gpu-carry/configs"], timeout_s=560)

Its files come back under the reply's files_at; copy them into benchmarks/gpu/results/ (README.md) and commit.
Without a GPU the same code runs on a tiny target: bash benchmarks/gpu/check.sh --cpu-smoke
EOF
