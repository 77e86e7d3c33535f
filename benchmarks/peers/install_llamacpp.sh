#!/usr/bin/env bash
# llama.cpp through llama-cpp-python in its own venv: $PEERS/llamacpp-venv.
#
# There is no prebuilt wheel for this platform, so pip compiles llama.cpp (needs cmake and a
# C/C++ compiler). Only the library the binding loads is built: tests, examples, tools, the
# server and the multimodal library are off, which takes the build to about 12 minutes on two
# cores. GGML_NATIVE builds for this CPU's instruction sets (AVX2, AVX-512, VNNI, AMX).
#
# LLAMACPP_ISA=avx2 builds for x86-64-v3 instead (AVX, AVX2, FMA, F16C, BMI2; no AVX-512, no
# AVX-VNNI) into $PEERS/llamacpp-avx2-venv: the peer as an AVX2-only CPU runs it, to compare
# with enginecore under ENGINECORE_CPU_ISA=x86-64-v3 on a CPU that has AVX-512.
set -euo pipefail
ISA=${LLAMACPP_ISA:-native}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
LEAN="-DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
case "$ISA" in
    native)
        V=${PEERS:?set PEERS to a directory outside the repository}/llamacpp-venv
        FLAGS="-DGGML_NATIVE=ON" ;;
    avx2)
        V=${PEERS:?set PEERS to a directory outside the repository}/llamacpp-avx2-venv
        FLAGS="-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF \
-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
-DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" ;;
    *)
        echo "LLAMACPP_ISA must be native or avx2, not '$ISA'" >&2
        exit 2 ;;
esac
if "$V/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python already installed in $V"
else
    python3 -m venv "$V"
    CMAKE_ARGS="$FLAGS $LEAN" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$V/bin/pip" install --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$VERSION" psutil
fi
"$V/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, \
llama_cpp.llama_print_system_info().decode())"
