#!/usr/bin/env bash
# The prepared GPU check (issue 23): everything a GPU must confirm, in
# priority order, each part's log and JSON written into OUTDIR as it ends, so
# a run cut short still returns what finished. About 6 minutes on an H100
# (KVD_GPU_BUDGET_S, default 360, bounds the whole; each part has its own cap).
#
#   tests/gpu/run.sh OUTDIR [PART...]    parts: env tests step e2e e2e_large families
#
# From a session that was lent a GPU (the `device` tool), in /work/main:
#   1. here, once:  tests/gpu/prepare.sh
#        (pip download of grpcio, grpcio-health-checking, grpcio-reflection,
#        protobuf and transformers at .venv's versions for cp312 manylinux into
#        .whl/, and SmolLM2's tokenizer files into .gpu/tokenizer)
#   2. device run:  command="tests/gpu/run.sh $OUT"
#                   carry=[".whl", ".gpu"]   timeout_s=480
#   3. read summary.json (the reply's tail prints it as a table), parts.log
#      for any part that failed, and copy gpu_step.json, gpu_e2e.json and
#      gpu_e2e_large.json into benchmarks/results/gpu/.
#   A rerun of one part after a fix:  command="tests/gpu/run.sh $OUT tests"
#
# What comes back is at most 8 files: every part logs into OUTDIR/parts.log;
# OUTDIR also gets summary.txt (each part's exit), tests.xml, the JSON files
# named below and summary.json. Parts:
#   env        versions, the GPU, the random-weight Llama built once on the GPU
#              (/tmp/kvd-random-llama, SmolLM2's vocabulary) for all the others
#   tests      pytest -m gpu, CUDA IPC first (tests.xml)
#   step       benchmarks/gpu_step.py --quick (gpu_step.json)
#   e2e        benchmarks/gpu_e2e.sh, the e2e workload (gpu_e2e.json)
#   e2e_large  the same, 256 requests over a 2,000-token prefix (gpu_e2e_large.json)
#   families   the ten families' tiny models in float32 via Triton (families.json)
set -uo pipefail
out=$(realpath -m "${1:?usage: tests/gpu/run.sh OUTDIR [PART...]}")
shift
mkdir -p "$out"
log="$out/parts.log"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" >>"$log" 2>&1
export PYTHONUNBUFFERED=1 KVD_GPU_OUT="$out" KVD_GPU_MODEL=/tmp/kvd-random-llama
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(env tests step e2e e2e_large families)
deadline=$(($(date +%s) + ${KVD_GPU_BUDGET_S:-360}))
tokenizer=.gpu/tokenizer

# part NAME CAP_S COMMAND...: at most CAP_S seconds, fewer when the budget is nearly spent.
part() {
    local name=$1 cap=$2
    shift 2
    local left=$((deadline - $(date +%s)))
    if ((left < 15)); then
        echo "$name: skipped, the budget is spent" | tee -a "$out/summary.txt"
        return
    fi
    ((cap > left)) && cap=$left
    local start
    start=$(date +%s)
    echo "=== $name (cap $cap s) $(date -u +%T)" >>"$log"
    timeout -k 10 "$cap" "$@" >>"$log" 2>&1
    local rc=$?
    echo "$name: exit $rc after $(($(date +%s) - start)) s (cap $cap s)" | tee -a "$out/summary.txt"
}

build_model() {
    nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv
    python3 -c "import torch, triton, transformers, grpc, google.protobuf as pb; \
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, \
'grpcio', grpc.__version__, 'protobuf', pb.__version__, 'gpu', torch.cuda.get_device_name())"
    [ -f "$KVD_GPU_MODEL/config.json" ] || python3 tests/gpu/random_llama.py "$KVD_GPU_MODEL" --tokenizer "$tokenizer"
}

gpu_tests() {
    # CUDA IPC first: nothing else works without it.
    python3 -m pytest -m gpu -v -p no:cacheprovider --junitxml "$out/tests.xml" \
        tests/gpu/test_cuda_ipc.py tests/gpu/test_copy_fence_cuda.py tests/gpu/test_kernels_cuda.py \
        $(ls tests/gpu/test_*.py | grep -v -e test_cuda_ipc -e test_copy_fence -e test_kernels_cuda -e test_families)
}

export -f build_model gpu_tests
export out tokenizer
for name in "${parts[@]}"; do
    case $name in
    env) part env 90 bash -c build_model ;;
    tests) part tests 180 bash -c gpu_tests ;;
    step) part step 90 python3 benchmarks/gpu_step.py --quick --json "$out/gpu_step.json" ;;
    e2e) part e2e 90 benchmarks/gpu_e2e.sh "$out/gpu_e2e.json" "$tokenizer" --rounds 1 ;;
    e2e_large) part e2e_large 120 benchmarks/gpu_e2e.sh "$out/gpu_e2e_large.json" "$tokenizer" --workload large \
        --token-budget 2048 --max-num-seqs 256 --num-blocks 16384 \
        --variants hf_continuous_batching,kvd --rounds 1 ;;
    families) part families 90 python3 -m pytest -m gpu -v -p no:cacheprovider tests/gpu/test_families_cuda.py ;;
    *) echo "unknown part $name (env tests step e2e e2e_large families)" >&2 ;;
    esac
done
python3 tests/gpu/summary.py "$out"
