#!/usr/bin/env bash
# Build llama.cpp's llama-bench (TARGETS="llama-bench llama-server" for the server too) as a benchmark peer, from the llama.cpp tree
# vendored in the `llama-cpp-python` sdist on PyPI (the only registry this project reaches), as a
# user would build it: cmake Release, defaults (GGML_NATIVE=ON), no curl. Never a dependency of
# tokenleap: the binaries land in benchmarks/.peer/ (git-ignored).
#   benchmarks/build_llamacpp.sh            # -> benchmarks/.peer/llama.cpp/build/bin/llama-bench
# BUILD names another build folder, CMAKE_EXTRA adds cmake flags; e.g. an AVX2-only peer on an
# AVX-512 host, to hold our AVX2 kernels against it:
#   BUILD=build-avx2 CMAKE_EXTRA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" benchmarks/build_llamacpp.sh
set -euo pipefail
cd "$(dirname "$0")"
PEER=.peer
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$PEER"
if [ ! -f "$PEER/llama_cpp_python-$VERSION.tar.gz" ]; then
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEER"
fi
if [ ! -d "$PEER/llama.cpp" ]; then
  tar -xzf "$PEER/llama_cpp_python-$VERSION.tar.gz" -C "$PEER" "llama_cpp_python-$VERSION/vendor/llama.cpp"
  mv "$PEER/llama_cpp_python-$VERSION/vendor/llama.cpp" "$PEER/llama.cpp"
  rm -rf "$PEER/llama_cpp_python-$VERSION"
fi
BUILD=${BUILD:-build}
cmake -S "$PEER/llama.cpp" -B "$PEER/llama.cpp/$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF ${CMAKE_EXTRA:-} > "$PEER/cmake.log"
cmake --build "$PEER/llama.cpp/$BUILD" --config Release -j "${JOBS:-2}" --target ${TARGETS:-llama-bench} > "$PEER/build.log"
echo "$PWD/$PEER/llama.cpp/$BUILD/bin/llama-bench"
