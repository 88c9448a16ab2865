#!/usr/bin/env bash
# The e2e benchmark on a CUDA machine: daemon + engine over CUDA IPC against
# transformers' generate and continuous batching on the same GPU, with the
# random-weight Llama of tests/gpu/random_llama.py (no downloads there).
#
#   benchmarks/gpu_e2e.sh OUT.json [TOKENIZER_DIR] [e2e.py flags...]
#
# TOKENIZER_DIR: a folder with SmolLM2's tokenizer.json, so the workload's
# real text tokenizes as on the CPU (default .gpu/tokenizer).
set -euo pipefail
out=$(realpath -m "$1"); tokenizer=$(realpath -m "${2:-.gpu/tokenizer}"); shift $(( $# >= 2 ? 2 : 1 ))
source "$(dirname "$0")/../tests/gpu/env.sh"
model=/tmp/kvd-random-llama
[ -f "$model/config.json" ] || python3 tests/gpu/random_llama.py "$model" --tokenizer "$tokenizer"
exec python3 benchmarks/e2e.py --model "$model" --device cuda --json "$out" "$@"
