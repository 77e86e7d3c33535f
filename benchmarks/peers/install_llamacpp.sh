#!/usr/bin/env bash
# llama.cpp through llama-cpp-python in its own venv: $PEERS/llamacpp-venv.
#
# There is no prebuilt wheel for this platform, so pip compiles llama.cpp (needs cmake and a
# C/C++ compiler). Only the library the binding loads is built: tests, examples, tools, the
# server and the multimodal library are off, which takes the build to about 12 minutes on two
# cores. GGML_NATIVE builds for this CPU's instruction sets (AVX2, AVX-512, VNNI, AMX).
set -euo pipefail
V=${PEERS:?set PEERS to a directory outside the repository}/llamacpp-venv
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
if "$V/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python already installed in $V"
else
    python3 -m venv "$V"
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$V/bin/pip" install "llama-cpp-python==$VERSION" psutil
fi
"$V/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, \
llama_cpp.llama_print_system_info().decode())"
