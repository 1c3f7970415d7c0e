#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the C++ source shipped in the llama-cpp-python sdist (PyPI),
# so the benchmark can compare kvserve with llama.cpp on the same GGUF without network access to GitHub.
#
# Result: third_party/llama.cpp/build/bin/llama-server, llama-quantize and llama-perplexity (third_party/ is
# gitignored).
# Idempotent: does nothing when the binaries already exist.
# Env: JOBS (default 2), LLAMA_CPP_PYTHON_VERSION (optional pin, e.g. 0.3.16), PYTHON (default: python),
# LLAMA_CPP_ISA: native (default: every instruction set this CPU has) or avx2 (AVX2, FMA, F16C and BMI2 only,
# no AVX-512 or VNNI: what an AVX2-only CPU runs, for `make bench ARGS="--isa avx2"`), built into
# build/bin/llama-server and build-avx2/bin/llama-server; the avx2 build makes the server alone.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/third_party/llama.cpp"
ISA="${LLAMA_CPP_ISA:-native}"
case "$ISA" in
    native) BUILD="$DEST/build"; TARGETS=(llama-server llama-quantize llama-perplexity) ;;
    avx2) BUILD="$DEST/build-avx2"; TARGETS=(llama-server) ;;
    *) echo "error: LLAMA_CPP_ISA must be native or avx2, not '$ISA'" >&2; exit 2 ;;
esac
BIN="$BUILD/bin/llama-server"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python}"

TOOLS="$BUILD/bin"
missing=0
for target in "${TARGETS[@]}"; do [[ -x "$TOOLS/$target" ]] || missing=1; done
if [[ "$missing" == 0 ]]; then
    echo "llama.cpp already built: $TOOLS"
    exit 0
fi
if [[ -x "$BIN" ]]; then  # an earlier build of the server alone: add the tools from the same source
    cmake --build "$BUILD" --config Release --target "${TARGETS[@]}" -j "$JOBS"
    exit 0
fi

for tool in cmake make c++; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "error: '$tool' not found; install it (e.g. apt-get install -y cmake build-essential) to build llama.cpp" >&2
        exit 2
    fi
done

if [[ ! -f "$DEST/CMakeLists.txt" ]]; then  # the source, from the sdist (another build may have unpacked it)
    mkdir -p "$ROOT/third_party"
    WORK="$(mktemp -d "$ROOT/third_party/.llama-sdist.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT

    SPEC="llama-cpp-python"
    if [[ -n "${LLAMA_CPP_PYTHON_VERSION:-}" ]]; then
        SPEC="llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}"
    fi
    echo "downloading the $SPEC sdist ..."
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --dest "$WORK" "$SPEC"
    SDIST="$(ls "$WORK"/llama_cpp_python-*.tar.gz "$WORK"/llama-cpp-python-*.tar.gz 2>/dev/null | head -n 1 || true)"
    if [[ -z "$SDIST" ]]; then
        echo "error: no llama-cpp-python sdist found in $WORK" >&2
        exit 1
    fi
    tar -xzf "$SDIST" -C "$WORK"
    SRC="$(find "$WORK" -maxdepth 3 -type d -path '*/vendor/llama.cpp' | head -n 1)"
    if [[ -z "$SRC" || ! -f "$SRC/CMakeLists.txt" ]]; then
        echo "error: vendor/llama.cpp not found inside $SDIST" >&2
        exit 1
    fi

    rm -rf "$DEST"
    mv "$SRC" "$DEST"
    echo "source: $(basename "$SDIST") -> $DEST"
fi

# Every instruction set this CPU has (-march=native), but on a CPU with AMX: there llama.cpp's AMX matrix
# products stop the server with SIGILL at its first product (tilezero before a tile configuration), so the
# build names the same features one by one, AMX left out (its AVX-512 and VNNI kernels and repacking stay).
ISA_FLAGS=(-DGGML_NATIVE=ON)
if [[ "$ISA" == avx2 ]]; then
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
        -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
        -DGGML_AMX_BF16=OFF)
elif grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
        -DGGML_BMI2="$(has bmi2)" -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
        -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
        -DGGML_AVX_VNNI="$(has avx_vnni)" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
cmake -S "$DEST" -B "$BUILD" \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    "${ISA_FLAGS[@]}" \
    -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF
# llama-quantize writes the K-quant test files (tests/engine/test_llama_quantize.py); llama-perplexity measures
# llama.cpp's KL divergence to float32 (python -m clients.bench.quality).
cmake --build "$BUILD" --config Release --target "${TARGETS[@]}" -j "$JOBS"

if [[ ! -x "$BIN" ]]; then
    echo "error: build finished but $BIN is missing" >&2
    exit 1
fi
echo "built: $BIN"
