#!/usr/bin/env bash
# Build llama.cpp (the sources llama-cpp-python 0.3.36 vendors) for the benchmarks' llama.cpp columns: its shared
# library (benchmarks/single_stream.py loads it through LLAMA_CPP_LIB_PATH=DIR/bin) and llama-server
# (benchmarks/vs_vllm.py --llama-server DIR/bin/llama-server). Usage: scripts/llama_cpp_build.sh avx512|avx2 [DIR]
#   avx512: AVX-512 with VNNI and BF16; avx2: AVX2 + FMA + F16C only (an AVX2 CPU's llama.cpp, to run beside kvql
#   built with KVQL_KERNEL_FLAGS=-mno-avx512f). AMX stays off: the -march=native build on this project's VMs (which
#   report AMX) dies with SIGSEGV on any prompt of more than one token (2026-12-07).
# Needs cmake and a C++ compiler; ~8 minutes on 2 cores. The python binding itself: python3 -m venv
# ~/.cache/kvql/llamacpp-venv && ~/.cache/kvql/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36
set -euo pipefail
isa=${1:?avx512 or avx2}
out=${2:-$HOME/.cache/kvql/llama-$isa}
src=$(mktemp -d)
pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d "$src" -q
tar xzf "$src"/llama_cpp_python-0.3.36.tar.gz -C "$src"
flags=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
       -DGGML_BMI2=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF -DBUILD_SHARED_LIBS=ON
       -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF)
if [ "$isa" = avx512 ]; then
  flags+=(-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
else
  flags+=(-DGGML_AVX512=OFF)
fi
cmake -S "$src"/llama_cpp_python-0.3.36/vendor/llama.cpp -B "$out" "${flags[@]}" > /dev/null
cmake --build "$out" -j"$(nproc)" --target llama llama-server > /dev/null
rm -rf "$src"
echo "built: $out/bin (LLAMA_CPP_LIB_PATH=$out/bin; --llama-server $out/bin/llama-server)"
