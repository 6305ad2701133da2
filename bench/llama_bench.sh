#!/usr/bin/env bash
# Baseline: llama.cpp's own llama-bench (CUDA, all layers on the GPU) on the same GGUFs we serve, so
# BENCHMARKS.md can put our tokens/s next to llama.cpp's. Runs on the GPU machine (no network), from
# the repo root, with the git-ignored .device/llama.cpp carried: a stripped llama.cpp tree (from the
# llama-cpp-python 0.3.36 sdist, llama.cpp commit 0c1e570) holding only what CMake needs for llama-bench.
#   bash bench/llama_bench.sh --build-only             # build only (e.g. in the background, ~5 min)
#   bash bench/llama_bench.sh [--no-build] M.gguf ...  # build unless the binary exists, then bench
# Builds the llama-bench and llama-server targets (the server for bench/serve_bench.py; API only, no
# web UI: the stripped tree has no UI assets, so an empty asset table is generated), sm_90, into
# $LLAMA_BUILD (default /tmp/llama-build); needs cmake >= 3.18, gcc and a CUDA toolkit with nvcc +
# cuBLAS (CUDA_HOME or /usr/local/cuda). LLAMA_CUDA=OFF builds for the CPU (checks the configuration
# on a machine without CUDA).
# Per model: pp512/pp4096 and tg128 at KV depths 0/128/1024/4096 (this llama-bench has -d/--n-depth;
# LLAMA_DEPTHS overrides; 128/1024/4096 are decode_bench.py's depths, bench/compare_llama.py pairs
# them), flash attention on, 3 repetitions; markdown on stdout, json in $OUT/llama_bench_<model>.json.
# Extra llama-bench flags: LLAMA_BENCH_ARGS (e.g. "-ub 2048" or "-ncmoe 20"); values of a flag given
# above (-p -n -d ...) are added to the list, not replaced.
set -euo pipefail
build_dir="${LLAMA_BUILD:-/tmp/llama-build}"
bin="$build_dir/bin/llama-bench"
server="$build_dir/bin/llama-server"
build=1 build_only=0
case "${1:-}" in
  --build-only) build_only=1; shift ;;
  --no-build) build=0; shift ;;
esac

if [ "$build" = 1 ] && { [ ! -x "$bin" ] || [ ! -x "$server" ]; }; then
  cuda="${CUDA_HOME:-/usr/local/cuda}"
  command -v nvcc >/dev/null || export PATH="$cuda/bin:$PATH"
  echo "== build llama-bench, llama-server (nvcc: $(command -v nvcc || echo MISSING), $(cmake --version | head -1))"
  t0=$(date +%s)
  ui=.device/llama.cpp/scripts/ui-assets.cmake
  if [ ! -f "$ui" ]; then  # the stripped tree lacks the UI provisioning script: serve no UI
    mkdir -p "$(dirname "$ui")"
    cat > "$ui" <<'CMAKE'
# Written by sparkpack's bench/llama_bench.sh: llama-server without its web UI (no assets embedded).
set(N_ASSETS 0)
set(ASSET_ARRAYS "")
set(ASSET_TABLE "")
set(USE_GZIP false)
configure_file("${UI_SOURCE_DIR}/ui.h.in" "${UI_BINARY_DIR}/ui.h" @ONLY)
configure_file("${UI_SOURCE_DIR}/ui.cpp.in" "${UI_BINARY_DIR}/ui.cpp" @ONLY)
CMAKE
  fi
  cmake -B "$build_dir" -S .device/llama.cpp -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA="${LLAMA_CUDA:-ON}" -DCMAKE_CUDA_ARCHITECTURES="${LLAMA_CUDA_ARCH:-90}" -DGGML_NATIVE=OFF \
    -DGGML_CCACHE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_COMMIT=0c1e570 -DLLAMA_BUILD_NUMBER=0 > "$build_dir.configure.log" 2>&1 \
    || { tail -30 "$build_dir.configure.log"; exit 1; }
  cmake --build "$build_dir" --target llama-bench llama-server -j"$(nproc)" > "$build_dir.build.log" 2>&1 \
    || { grep -m20 -B2 -A5 -i "error" "$build_dir.build.log"; tail -20 "$build_dir.build.log"; exit 1; }
  echo "built $bin and $server in $(( $(date +%s) - t0 )) s"
fi
[ "$build_only" = 1 ] && exit 0
[ -x "$bin" ] || { echo "no $bin: build first (bash bench/llama_bench.sh --build-only)" >&2; exit 1; }

mkdir -p "${OUT:-/tmp}"
for model in "$@"; do
  json="${OUT:-/tmp}/llama_bench_$(basename "$model" .gguf).json"
  echo "== llama-bench $model"
  # json (pure) on stdout goes to the file; the markdown table (-oe md) and any logs on stderr to our stdout
  "$bin" -m "$model" -ngl 99 -fa 1 -p 512,4096 -n 128 -d "${LLAMA_DEPTHS:-0,128,1024,4096}" -r 3 ${LLAMA_BENCH_ARGS:-} \
    -o json -oe md 2>&1 >"$json" || echo "llama-bench FAILED on $model (rc $?)"
  echo "json: $json"
done
