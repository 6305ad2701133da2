#!/usr/bin/env bash
# The all-GPU prefill measured at several commits in one device call (bench/prefill_bisect.py):
# which commit made a prompt's prefill slower, on one machine, each commit in its own process.
#   on the CPU machine (repo root): bash bench/prefill_bisect.sh pack COMMIT...
#     writes .device/bisect/NN-HASH.tar (each commit's four package folders) and clears older ones;
#   on the GPU machine, carrying .device/bisect (and .whl where the steps need it):
#     bash bench/prefill_bisect.sh run [prefill_bisect.py options, e.g. --rounds 1 --profile]
#     (or each commit's one-shot spark-run: run --spark-run "--vram 14GiB --max-tokens 256"
#      --prompt-file .device/corpus/agent_prompts/codex_gpt5_codex.md)
#     unpacks each commit under /var/tmp/sparkpack-bisect, reuses (or synthesizes) the gpu_session
#     model, and prints one line per commit and round; JSON to $OUT/prefill_bisect.json.
set -euo pipefail
what="${1:?usage: prefill_bisect.sh pack COMMIT... | run [options]}"
shift
dir=.device/bisect
case "$what" in
  pack)
    mkdir -p "$dir"
    rm -f "$dir"/*.tar
    i=0
    for c in "$@"; do
      i=$((i + 1))
      h=$(git rev-parse --short=7 "$c^{commit}")
      git archive --format=tar "$h" formats calibrate repack runtime > "$dir/$(printf %02d $i)-$h.tar"
    done
    ls -l "$dir" ;;
  run)
    export BISECT_START="${BISECT_START:-$(date +%s)}"  # the budget counts the synth too
    if [ -d .whl ]; then
      . bench/device_env.sh
    else  # (device_env.sh without wheels: this checkout as sparkpack, for the synth)
      mkdir -p /tmp/site/sparkpack
      for p in formats calibrate repack runtime; do ln -sfn "$PWD/$p" "/tmp/site/sparkpack/$p"; done
      export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    fi
    work="${BENCH_DIR:-/var/tmp/sparkpack-bench}" trees="${BISECT_DIR:-/var/tmp/sparkpack-bisect}"
    model="$work/qwen36-q4km.gguf"  # gpu_session.sh's model, reused on a warm machine
    mkdir -p "$work" "$trees"
    if [ ! -f "$model" ]; then
      echo "== synthesizing $model (a fresh machine)"
      python3 -m sparkpack.repack.cli synth --arch qwen35moe --preset qwen3.6-35b-a3b --quant Q4_K_M -j 16 \
        --skew reference -o "$model" >/dev/null
      sync  # nothing timed while the model's pages are written back
    fi
    list=()
    for t in "$dir"/*.tar; do
      name=$(basename "$t" .tar)
      rm -rf "${trees:?}/$name"
      mkdir -p "$trees/$name/site/sparkpack"
      tar -xf "$t" -C "$trees/$name"
      for p in formats calibrate repack runtime; do ln -sfn "$trees/$name/$p" "$trees/$name/site/sparkpack/$p"; done
      list+=("$trees/$name")
    done
    nvidia-smi --query-gpu=name --format=csv,noheader || true
    python3 bench/prefill_bisect.py "$model" "${list[@]}" "$@" ;;
  *) echo "usage: prefill_bisect.sh pack COMMIT... | run [options]" >&2; exit 2 ;;
esac
