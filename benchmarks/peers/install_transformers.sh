#!/usr/bin/env bash
# transformers in its own venv: $PEERS/transformers-venv, with the same CPU torch as ours.
set -euo pipefail
V=${PEERS:?set PEERS to a directory outside the repository}/transformers-venv
python3 -m venv "$V"
"$V/bin/pip" install --quiet --upgrade pip
"$V/bin/pip" install --quiet torch==2.13.0 "transformers${TRANSFORMERS_SPEC:-}" accelerate psutil
"$V/bin/python" -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
