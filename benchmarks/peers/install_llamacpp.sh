#!/usr/bin/env bash
# llama.cpp through llama-cpp-python in its own venv: $PEERS/llamacpp-venv.
#
# There is no prebuilt wheel for this platform, so pip compiles llama.cpp (about 30 minutes
# on two cores; needs cmake and a C/C++ compiler). The build detects the CPU's instruction
# sets (AVX2, AVX-512, AMX) and uses them.
set -euo pipefail
V=${PEERS:?set PEERS to a directory outside the repository}/llamacpp-venv
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
if "$V/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python already installed in $V"
else
    python3 -m venv "$V"
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$V/bin/pip" install "llama-cpp-python[server]==$VERSION" psutil
fi
"$V/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
