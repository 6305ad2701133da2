#!/usr/bin/env bash
# One device call that measures the formats pipeline at full size: synth a Qwen3.6-35B-A3B-shaped
# Q4_K_M GGUF (~20 GB), split it into a pack, verify, join back (byte-compared), and measure zstd
# on a layer-cut copy; then run the forward and dequant tests on CUDA.
#   usage (repo root, on the GPU machine, wheels from .whl/ carried): bash bench/gpu_session.sh [steps]
#   the wheels, once per session on the CPU machine: bash ../shared/device/prepare.sh $(cat bench/device_wheels.txt)
#   (the server and its test clients; the device has torch, triton, transformers, xxhash, prometheus-client,
#   pytest-xdist, not these); then carry .whl (and .device/corpus, a copy of ../shared/corpora/lucebox-hub).
# QUANT=IQ2_M (any repack synth --quant) makes the synthetic models of that mix instead of Q4_K_M.
# steps: any of synth split compress tests cudatests kernels calib store staged decode draft llama side presets serve parallel batchprof conversations learning long lowbit_llama build (default: synth split compress tests)
# cudatests: the runtime's CUDA tests (kernels, expert store, pack integrity, graphs, prefix reuse, served
#   GPU path, generation, learning, calibration replay, staged prefill, batched steps, drafting) on 15 xdist workers
#   per GPU (CUDA_TESTS: other files; CUDA_VISIBLE_DEVICES: which GPUs).
# calib: bench/calibrate_speed.py on BENCH_CORPUS (default: corpora/): repack calibrate's tok/s and peak
#   RSS all-GPU and at --vram 14GiB next to the all-GPU prefill of the same windows.
# store: the expert store at partial residency (bench/store_bench.py) on a --skew reference model,
#   calibrated on .device/corpus/bench_agent.jsonl, measured on .device/corpus/mt_bench_questions.jsonl.
# staged: prefill at partial residency with staged calls off/on (bench/staged_prefill.py), the threshold's crossover.
# decode: all-GPU decode (CUDA graph vs eager) and prefill speed (bench/decode_bench.py).
# draft: speculative decoding (issue 47, bench/draft_bench.py): a verify step of K = 1..4 drafts next to a plain
#   step, and decode tok/s at forced acceptance 0.5/0.7/0.9 (random weights: the acceptance is set, not measured),
#   all-GPU and at DRAFT_VRAM (14GiB), one process each; DRAFT_ARGS adds options.
# llama: llama.cpp's llama-bench on the same model (bench/llama_bench.sh; .device/llama.cpp carried).
# side: issue 7's side-by-side in one call: llama.cpp builds (niced, in the background) while the
#   model is written; then our decode_bench, llama-bench on the same file and
#   bench/compare_llama.py's table (ours / llama.cpp). Nothing is timed while the build runs.
#   SIDE_TESTS="tests/..." also runs those tests on CUDA while the model is written (before any timing),
#   cut off after SIDE_TESTS_TIMEOUT seconds (180); their log goes to $OUT/tests.log.
# presets: side-by-side on the laguna-xs2 and qwen3-30b-a3b shapes (llama-bench built in the background
#   while the first model is written, unless already built on a machine still warm).
# serve: served agent session next to llama-server at --vram 14GiB (bench/serve_bench.py, prompts from
#   .device/corpus/agent_prompts); SERVE_ARGS adds options (--spark-arg=X: both of ours, --serve-arg=X: the server only;
#   --vram 100GiB: every expert on the GPU); SERVE_PARALLEL="default 1" runs it for the default server and for
#   --parallel 1, one after the other (the second's files in $OUT/parallel_1).
# parallel: concurrent requests (issue 46): bench/parallel_bench.py, --parallel 4 next to llama-server -np 4.
# batchprof: how a batched decode step scales with its rows (bench/profile_decode.py --batch 1 2 4): the captured
#   step's time and each kernel's device time per step, all-GPU and at BATCH_HOT (0.6) of the experts hot.
# conversations: many conversations, one server (issue 42): A1, A2, side, A3, B1, A4, B2, A5 and a restart
#   with --cache-dir, next to llama-server at --vram 14GiB (bench/conversations_bench.py; llama-server built
#   meanwhile when .device/llama.cpp is carried, else its column is left out); CONV_PRESET picks the shape
#   (qwen35moe:qwen3.6-35b-a3b, the default, or laguna:laguna-xs2); CONV_ARGS adds options
#   (e.g. "--n-cpu-moe 17": skips llama-server's probes for the least that fits).
# learning: bench/learning_bench.py (issue 30): live learning from no profile vs an offline profile, at --vram 14GiB.
# long: long prompts and long context, fresh spark-run per length next to llama-bench (bench/long_context.py);
#   LONG_ARGS adds options (e.g. "--lengths 8192 32768 131072 --kv auto q8_0").
# lowbit_llama: issue 45's llama.cpp side on the low-bit synthetic files (LOWBIT_QUANTS, default IQ2_M IQ2_XXS
#   IQ3_XXS; the same files QUANT=<quant> gives the other steps): llama-bench pp8192 + tg128 all-GPU, and at
#   LOWBIT_VRAM (8GiB) with -ncmoe N from `repack export --llama-cpp --ctx 8320` (the bench's prompt + generated
#   tokens) per KV type (LOWBIT_KV: f16 q8_0);
#   LOWBIT_REPS (2) repetitions; json in $OUT/llama_lowbit_<quant>_<config>.json. Builds llama-bench meanwhile.
# build: only build llama-bench (then side/presets on the same warm machine skip the build).
#   PRESETS="qwen3moe:qwen3-30b-a3b" runs one (each takes ~4-5 minutes: one per call fits the limit).
set -euo pipefail
steps="${*:-synth split compress tests}"
. bench/device_env.sh
work="${BENCH_DIR:-/var/tmp/sparkpack-bench}"
mkdir -p "$work"
echo "== machine"; nproc; free -g | head -2; df -h "$work" /dev/shm | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
quant="${QUANT:-Q4_K_M}"  # the synthetic models' llama.cpp mix (QUANT=IQ2_M ...: the low-bit files)
model="$work/qwen36-q4km.gguf"
[ "$quant" = Q4_K_M ] || model="$work/qwen36-$(echo "$quant" | tr 'A-Z' 'a-z').gguf"
ensure_model() {  # PATH ARCH PRESET: the $quant synthetic model with reference skew, unless PATH exists
  [ -f "$1" ] || python3 -m sparkpack.repack.cli synth --arch "$2" --preset "$3" --quant "$quant" -j 16 --skew reference -o "$1" >/dev/null
}
ensure_profile() {  # MODEL PROFILE: calibrated on the agent corpus, unless PROFILE exists
  # (not MODEL.profile.json: uniform runs must not pick it up)
  [ -f "$2" ] || /usr/bin/time -f "calibrate: %e s, peak RSS %M KiB" python3 -m sparkpack.repack.cli calibrate "$1" \
    --corpus .device/corpus/bench_agent.jsonl --device cuda --max-tokens "${CALIB_TOKENS:-8192}" -o "$2" --quiet
}
for step in $steps; do
  case "$step" in
    synth)
      echo "== synth (disk)"
      python3 bench/synth_bench.py --arch qwen35moe --preset qwen3.6-35b-a3b --quant Q4_K_M -o "$model" --keep ;;
    split)
      echo "== split / verify / join (page cache warm from synth)"
      python3 bench/split_bench.py "$model" --hot-fraction 0.6 --workdir "$work" ;;
    compress)
      echo "== zstd ratio on the first 4 layers (same shapes)"
      cut="$work/cut.gguf"
      python3 -m sparkpack.repack.cli synth --arch qwen35moe --preset qwen3.6-35b-a3b --quant Q4_K_M --layers 4 -j 16 -o "$cut" >/dev/null
      python3 bench/split_bench.py "$cut" --hot-fraction 0.6 --workdir "$work" --compress
      rm -f "$cut" ;;
    tests)
      echo "== forward + dequant tests on CUDA"
      SPARKPACK_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --tb=short ${TESTS:-tests/test_forward.py tests/test_dequant.py tests/test_kernels.py} \
        > "${OUT:-$work}/tests.log" 2>&1 || true
      tail -15 "${OUT:-$work}/tests.log" ;;
    cudatests)
      # The runtime's CUDA tests, spread over 15 pytest-xdist workers (the device has pytest-xdist),
      # each with ONE CPU thread: most of these tests run tiny models, partly on the CPU, and 15
      # processes of 16 OpenMP threads each on 16 cores ran ~20x slower (no run finished inside a
      # 10-minute call before this; one thread each: the whole set in ~200 s on a fresh machine,
      # Triton compiling from a cold cache). CUDA_TESTS_TIMEOUT (480 s) caps it with SIGINT, so
      # pytest still prints its summary; the log goes to $OUT/cuda.log.
      # On a machine of several GPUs, 15 workers per GPU (as many as the cores allow), each worker
      # on one of them (tests/conftest.py, SPARKPACK_TEST_GPUS).
      gpus=$(nvidia-smi -L | grep -c '^GPU')  # (or those CUDA_VISIBLE_DEVICES names)
      [ -z "${CUDA_VISIBLE_DEVICES:-}" ] || gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
      workers=$(( 15 * gpus < $(nproc) - 1 ? 15 * gpus : $(nproc) - 1 ))
      echo "== CUDA tests (xdist, one thread a worker: $workers workers on $gpus GPUs)"
      OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 SPARKPACK_TEST_DEVICE=cuda SPARKPACK_TEST_GPUS=$gpus \
        timeout -s INT -k 30 "${CUDA_TESTS_TIMEOUT:-480}" \
        python3 -m pytest -n "$workers" --dist load -v -p no:cacheprovider -p no:benchmark --tb=short --durations=15 \
        ${CUDA_TESTS:-tests/test_kernels.py tests/test_attention_kernel.py tests/test_forward.py tests/test_expert_store.py tests/test_pack_integrity.py tests/test_calibrate.py \
        tests/test_graph.py tests/test_prefix_reuse.py tests/test_conversation_cache.py tests/test_server_gpu.py tests/test_generate.py tests/test_learning.py \
        tests/test_calibrate_replay.py tests/test_staged_prefill.py tests/test_grammar.py tests/test_speculative.py \
        tests/test_decode_batch.py tests/test_batch_kernels.py tests/test_deltanet_rows.py tests/test_server_parallel.py tests/test_mtp.py \
        tests/test_mtp_drafter.py tests/test_batch_attention.py tests/test_chunked_prefill.py tests/test_request_path.py \
        tests/test_q8dot.py tests/test_dense_kernels.py tests/test_fused_steps.py tests/test_dequant.py} > "${OUT:-$work}/cuda.log" 2>&1 || true
      grep -oE "(PASSED|FAILED|SKIPPED|ERROR) tests/[a-z_]+\.py" "${OUT:-$work}/cuda.log" | sort | uniq -c
      sed -n '/short test summary/,$p' "${OUT:-$work}/cuda.log" | cut -c1-240 ;;
    calib)
      echo "== calibration throughput (full-size synthetic model, CUDA)"
      ensure_model "$model" qwen35moe qwen3.6-35b-a3b
      python3 bench/calibrate_speed.py --model "$model" --corpus "${BENCH_CORPUS:-corpora}" \
        --max-tokens "${CALIB_TOKENS:-8192}" --md "${OUT:-$work}/calibrate_speed.md" ;;
    store)
      echo "== expert store at partial residency (full-size model, skewed routing)"
      ensure_model "$model" qwen35moe qwen3.6-35b-a3b
      prof="$work/agent.profile.json"
      ensure_profile "$model" "$prof"
      python3 bench/store_bench.py "$model" --profile "$prof" --prompts .device/corpus/mt_bench_questions.jsonl \
        --tokens "${STORE_TOKENS:-48}" --json "${OUT:-$work}/store_bench.json" ${STORE_ARGS:-} ;;
    staged)
      # prefill at partial residency, staging off/on (bench/staged_prefill.py), calibrated placement;
      # STAGED_PRESETS (default qwen35moe:qwen3.6-35b-a3b), STAGED_ARGS (default --hot-fraction 0.6 --all-gpu)
      for preset in ${STAGED_PRESETS:-qwen35moe:qwen3.6-35b-a3b}; do
        arch="${preset%%:*}" name="${preset#*:}"
        m="$work/$name-q4km.gguf" p="$work/$name.agent.profile.json"
        if [ "$name" = qwen3.6-35b-a3b ]; then m="$model" p="$work/agent.profile.json"; fi  # the store step's
        echo "== staged prefill: $name"
        ensure_model "$m" "$arch" "$name"
        ensure_profile "$m" "$p"
        python3 bench/staged_prefill.py "$m" --profile "$p" ${STAGED_ARGS:---hot-fraction 0.6 --all-gpu} \
          --md "${OUT:-$work}/staged_prefill_$name.md" --json "${OUT:-$work}/staged_prefill_$name.json"
      done ;;
    decode)
      ensure_model "$model" qwen35moe qwen3.6-35b-a3b
      python3 bench/decode_bench.py "$model" --json "${OUT:-$work}/decode_bench.json" ;;
    draft)
      ensure_model "$model" qwen35moe qwen3.6-35b-a3b
      for vram in all "${DRAFT_VRAM:-14GiB}"; do
        python3 bench/draft_bench.py "$model" --vram "$vram" --json "${OUT:-$work}/draft_bench_$vram.json" ${DRAFT_ARGS:-}
      done ;;
    llama)
      ensure_model "$model" qwen35moe qwen3.6-35b-a3b
      bash bench/llama_bench.sh "$model" ;;
    side)
      echo "== side by side with llama.cpp (build in the background)"
      nice -n 19 bash bench/llama_bench.sh --build-only > "$work/llama_build.log" 2>&1 &
      build=$!
      tests=""
      if [ -n "${SIDE_TESTS:-}" ]; then  # CUDA tests while the model is written; done before any timing
        # capped: the tests share the CPU with the synth and the build, and must not eat the call
        SPARKPACK_TEST_DEVICE=cuda timeout "${SIDE_TESTS_TIMEOUT:-180}" python3 -m pytest -q -p no:cacheprovider --tb=short $SIDE_TESTS \
          > "${OUT:-$work}/tests.log" 2>&1 &
        tests=$!
      fi
      [ -f "$model" ] || python3 -m sparkpack.repack.cli synth --arch qwen35moe --preset qwen3.6-35b-a3b --quant "$quant" -j 8 --skew reference -o "$model" >/dev/null
      sync  # as in presets: no page-cache writeback while a prefill is timed
      if [ -n "$tests" ]; then wait "$tests" || true; echo "== CUDA tests"; tail -15 "${OUT:-$work}/tests.log"; fi
      # nothing is timed while llama.cpp compiles: a prefill is partly host-bound, and a 16-job
      # build even at nice 19 took it from ~8900 to ~5100 tok/s (sessions 12-13)
      wait "$build" || { tail -20 "$work/llama_build.log"; exit 1; }
      tail -1 "$work/llama_build.log"
      python3 bench/decode_bench.py "$model" --json "${OUT:-$work}/decode_bench.json" ${DECODE_ARGS:-} || echo "decode_bench failed (rc $?)"
      bash bench/llama_bench.sh --no-build "$model"
      python3 bench/compare_llama.py "${OUT:-$work}/decode_bench.json" "${OUT:-/tmp}/llama_bench_$(basename "$model" .gguf).json" \
        --md "${OUT:-$work}/side_by_side.md" || true ;;
    presets)
      build=""
      if [ ! -x "${LLAMA_BUILD:-/tmp/llama-build}/bin/llama-bench" ]; then  # a fresh machine: build meanwhile
        nice -n 19 bash bench/llama_bench.sh --build-only > "$work/llama_build.log" 2>&1 &
        build=$!
      fi
      for preset in ${PRESETS:-qwen3moe:qwen3-30b-a3b laguna:laguna-xs2}; do
        arch="${preset%%:*}" name="${preset#*:}" m="$work/$name-q4km.gguf"
        echo "== $name"
        # always written fresh: a file an earlier, cut-off call left behind may predate the writer
        # (llama.cpp refused one such file in session 11)
        python3 -m sparkpack.repack.cli synth --arch "$arch" --preset "$name" --quant Q4_K_M -j 16 --skew reference -o "$m" >/dev/null
        sync  # the ~18 GB just written is flushed before anything is timed, not during a host-bound prefill
        if [ -n "$build" ]; then wait "$build" || tail -20 "$work/llama_build.log"; build=""; fi  # nothing timed meanwhile
        python3 bench/decode_bench.py "$m" --depths 128 1024 4096 --prefill 512 4096 --json "${OUT:-$work}/decode_bench_$name.json" \
          || echo "decode_bench failed on $name (rc $?)"
        if [ -x "${LLAMA_BUILD:-/tmp/llama-build}/bin/llama-bench" ]; then
          LLAMA_DEPTHS=0,128,1024,4096 bash bench/llama_bench.sh --no-build "$m" || true
          python3 bench/compare_llama.py "${OUT:-$work}/decode_bench_$name.json" "${OUT:-/tmp}/llama_bench_$name-q4km.json" \
            --md "${OUT:-$work}/side_by_side_$name.md" || true
        fi
        rm -f "$m"
      done ;;
    serve)
      ensure_model "$model" qwen35moe qwen3.6-35b-a3b
      for par in ${SERVE_PARALLEL:-default}; do  # e.g. SERVE_PARALLEL="default 1": the default server and --parallel 1
        out="${OUT:-$work}" extra=""
        if [ "$par" != default ]; then out="$out/parallel_$par" extra="--serve-arg=--parallel=$par"; fi
        echo "== served session, --parallel $par"
        python3 bench/serve_bench.py "$model" --prompts .device/corpus/agent_prompts --out "$out" $extra ${SERVE_ARGS:-}
      done ;;
    parallel)
      # issue 46: 1, 2 and 4 streams at once and a short request during a long reply, spark-run --serve
      # --parallel 4 next to llama-server -np 4 when built (bench/parallel_bench.py); PAR_VRAM: all (default) or a budget.
      ensure_model "$model" qwen35moe qwen3.6-35b-a3b
      python3 bench/parallel_bench.py "$model" --prompts .device/corpus/agent_prompts --vram "${PAR_VRAM:-all}" \
        --out "${OUT:-$work}" ${PAR_ARGS:-} ;;
    batchprof)
      ensure_model "$model" qwen35moe qwen3.6-35b-a3b
      for hot in 1.0 "${BATCH_HOT:-0.6}"; do
        echo "== batched steps, hot fraction $hot"
        python3 bench/profile_decode.py "$model" --batch 1 2 4 --steps 8 --prompt 128 --hot-fraction "$hot"
      done ;;
    conversations)
      preset="${CONV_PRESET:-qwen35moe:qwen3.6-35b-a3b}"
      m="$model"
      [ "$preset" = "qwen35moe:qwen3.6-35b-a3b" ] || m="$work/${preset#*:}-q4km.gguf"
      build=""
      if [ ! -x "${LLAMA_BUILD:-/tmp/llama-build}/bin/llama-server" ] && [ -d .device/llama.cpp ]; then
        nice -n 19 bash bench/llama_bench.sh --build-only > "$work/llama_build.log" 2>&1 &  # while the model is written
        build=$!
      fi
      ensure_model "$m" "${preset%%:*}" "${preset#*:}"
      sync  # nothing timed while the model's pages are written back
      if [ -n "$build" ]; then
        wait "$build" || { echo "llama-server did not build: its column is left out"; tail -5 "$work/llama_build.log"; }
      fi
      [ -x "${LLAMA_BUILD:-/tmp/llama-build}/bin/llama-server" ] || echo "(no llama-server: carry .device/llama.cpp for its column)"
      python3 bench/conversations_bench.py "$m" --prompts .device/corpus/agent_prompts --vram 14GiB --ctx 65536 \
        --out "${OUT:-$work}" ${CONV_ARGS:-} ;;
    learning)
      # issue 30's benchmark: a server with no profile learning the placement from held-out agent
      # conversations at --vram 14GiB, then a restart, against an offline-calibrated profile;
      # LEARNING_ARGS overrides the request counts and lengths.
      ensure_model "$model" qwen35moe qwen3.6-35b-a3b
      python3 bench/learning_bench.py "$model" --corpus .device/corpus/bench_agent.jsonl \
        --corpus .device/corpus/mt_bench_questions.jsonl --system-prompt .device/corpus/agent_prompts/codex_gpt5_codex.md \
        --vram 14GiB --ctx 32768 ${LEARNING_ARGS:---requests 20 --after-restart 5 --max-tokens 32} --out "${OUT:-$work}" ;;
    long)
      ensure_model "$model" qwen35moe qwen3.6-35b-a3b
      python3 bench/long_context.py "$model" --out "${OUT:-$work}" ${LONG_ARGS:-} ;;
    lowbit_llama)
      build=""
      if [ ! -x "${LLAMA_BUILD:-/tmp/llama-build}/bin/llama-bench" ]; then  # a fresh machine: build meanwhile
        nice -n 19 bash bench/llama_bench.sh --build-only > "$work/llama_build.log" 2>&1 &
        build=$!
      fi
      for q in ${LOWBIT_QUANTS:-IQ2_M IQ2_XXS IQ3_XXS}; do
        m="$work/qwen36-$(echo "$q" | tr 'A-Z' 'a-z').gguf"
        [ -f "$m" ] || python3 -m sparkpack.repack.cli synth --arch qwen35moe --preset qwen3.6-35b-a3b --quant "$q" -j 16 \
          --skew reference -o "$m" >/dev/null
      done
      sync  # nothing timed while the files are flushed or llama.cpp compiles
      if [ -n "$build" ]; then wait "$build" || { tail -20 "$work/llama_build.log"; exit 1; }; fi
      bin="${LLAMA_BUILD:-/tmp/llama-build}/bin/llama-bench"
      mkdir -p "${OUT:-$work}"
      for q in ${LOWBIT_QUANTS:-IQ2_M IQ2_XXS IQ3_XXS}; do
        m="$work/qwen36-$(echo "$q" | tr 'A-Z' 'a-z').gguf"
        configs="all-gpu|-ngl 99"
        for kv in ${LOWBIT_KV:-f16 q8_0}; do  # the least expert layers on the CPU within LOWBIT_VRAM
          n=$(python3 -m sparkpack.repack.cli export "$m" --llama-cpp --vram "${LOWBIT_VRAM:-8GiB}" --kv-type "$kv" \
            --ctx 8320 --json \
            | python3 -c "import json, sys; print(json.load(sys.stdin)['n_cpu_moe'] or 0)") || { echo "export failed on $m"; continue; }
          configs="$configs
${LOWBIT_VRAM:-8GiB}-$kv|-ngl 99 -ncmoe $n -ctk $kv -ctv $kv"
        done
        while IFS='|' read -r name args; do
          echo "== llama-bench $q $name: $args"
          "$bin" -m "$m" $args -fa 1 -p 8192 -n 128 -r "${LOWBIT_REPS:-2}" -o json -oe md \
            2>&1 >"${OUT:-$work}/llama_lowbit_${q}_${name}.json" || echo "llama-bench FAILED ($q $name)"
        done <<< "$configs"
      done ;;
    build)
      bash bench/llama_bench.sh --build-only ;;
    kernels)
      echo "== kernels"
      python3 bench/kernels_bench.py ;;
  esac
done
