#!/usr/bin/env bash
# The prepared GPU check (issue 31): everything a GPU must confirm, in
# priority order, in stages that each run under their own time cap and leave
# their evidence in OUTDIR as they end, so a run cut short still returns what
# finished and why the rest failed.
#
#   tests/gpu/run.sh OUTDIR [STAGE...]
#
# From a session lent a GPU (the `device` tool), in the repository root:
#   1. here, once:  tests/gpu/prepare.sh
#        (wheels of what the GPU image lacks into .whl/, each checked against
#        the image's packages; SmolLM2's tokenizer into .gpu/tokenizer; it
#        prints what travels: about 27 MB of the 64 MiB)
#   2. device run:  command="tests/gpu/run.sh $OUT"  carry=[".whl", ".gpu"]  timeout_s=480
#        (KVD_GPU_BUDGET_S, default 420, bounds the stages; the rest of the
#        480 s is the wheels' install and the summary)
#   3. read the reply's tail (the stage table and the targets), then
#        summary.json, parts.log for a failed stage; copy gpu_step.json,
#        gpu_e2e.json and gpu_e2e_large.json into benchmarks/results/gpu/.
#   A rerun of some stages after a fix (preflight first: it warms Triton's
#   cache for the others):  command="tests/gpu/run.sh $OUT preflight model kernels"
#
# Stages (cap in seconds; pytest's per-test timeout is shorter than its cap):
#   preflight  60  tests/gpu/preflight.py: the machine, every import, every kernel
#                  variant compiled (in parallel, into Triton's cache) and launched,
#                  CUDA IPC between two processes, one graph replay against eager
#   model      45  the random-weight Llama built once on the GPU (/tmp/kvd-random-llama)
#   ipc        60  test_cuda_ipc, test_copy_fence_cuda
#   kernels    60  test_kernels_cuda (bf16 against float64 among them)
#   inprocess  90  test_triton_step; test_graphs_cuda's in-process tests
#   step       90  benchmarks/gpu_step.py --quick (gpu_step.json, rewritten per case)
#   engine    150  test_engine_cuda, test_offload_cuda, the graphed engine's restart
#   e2e        90  benchmarks/gpu_e2e.sh: hf_generate, hf_continuous_batching, kvd
#   e2e_large 120  the same over 256 requests and a 2,000-token prefix (hf_cb, kvd)
#   families   90  the ten families in float32 through Triton (families.json)
# The stages that start daemons and engines (engine, e2e, e2e_large,
# families) are skipped, with the reason, when CUDA IPC failed in preflight
# or in the ipc stage.
#
# OUTDIR gets at most 8 files, no folders: parts.log (every stage's output,
# failures with their tracebacks and log tails as they happen), summary.json
# (the stage table, the targets, the tests; rewritten after each stage),
# preflight.json, tests.xml (every pytest stage merged), gpu_step.json,
# gpu_e2e.json, gpu_e2e_large.json, families.json.
set -uo pipefail
out=$(realpath -m "${1:?usage: tests/gpu/run.sh OUTDIR [STAGE...]}")
shift
mkdir -p "$out"
log="$out/parts.log"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" >>"$log" 2>&1
export PYTHONUNBUFFERED=1 KVD_GPU_OUT="$out" KVD_GPU_MODEL=/tmp/kvd-random-llama
export KVD_GPU_WORK=/tmp/kvd-gpu-run # this run's junit files, merged into OUTDIR/tests.xml
rm -rf "$KVD_GPU_WORK" && mkdir -p "$KVD_GPU_WORK"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(preflight model ipc kernels inprocess step engine e2e e2e_large families)
deadline=$(($(date +%s) + ${KVD_GPU_BUDGET_S:-420}))
tokenizer=.gpu/tokenizer
no_ipc=""

record() { python3 tests/gpu/summary.py "$out" --stage "$@" | tee -a "$log"; }

# stage NAME CAP_S COMMAND...: at most CAP_S seconds, fewer when the budget is nearly spent.
stage() {
    local name=$1 cap=$2
    shift 2
    local left=$((deadline - $(date +%s)))
    if ((left < 15)); then
        record "$name" skipped 0 "$cap" "the budget (KVD_GPU_BUDGET_S) is spent"
        return 1
    fi
    ((cap > left)) && cap=$left
    echo "=== $name (cap $cap s) $(date -u +%T)" >>"$log"
    local start=$(date +%s)
    timeout -k 10 "$cap" "$@" >>"$log" 2>&1
    local rc=$?
    record "$name" "$rc" $(($(date +%s) - start)) "$cap" ""
    return $rc
}

# needs_ipc NAME CAP: false (and the stage recorded as skipped) when CUDA IPC failed.
needs_ipc() {
    [ -z "$no_ipc" ] && return 0
    record "$1" skipped 0 "$2" "$no_ipc"
    return 1
}

# pytest_stage NAME CAP PER_TEST_TIMEOUT FILES_OR_NODES...
pytest_stage() {
    local name=$1 cap=$2 per_test=$3
    shift 3
    stage "$name" "$cap" python3 -m pytest -m gpu -v -rA --tb=long -p no:cacheprovider --timeout "$per_test" \
        --junitxml "$KVD_GPU_WORK/junit-$name.xml" "$@"
}

graph_tests=tests/gpu/test_graphs_cuda.py
restart_test=$graph_tests::test_the_engine_matches_generate_with_graphs_and_captures_again_after_its_daemon_restarts
for name in "${stages[@]}"; do
    case $name in
    preflight)
        stage preflight 60 python3 tests/gpu/preflight.py "$out/preflight.json"
        [ $? -eq 3 ] && no_ipc="preflight's CUDA IPC check failed (see preflight.json)" ;;
    model)
        stage model 45 python3 tests/gpu/random_llama.py "$KVD_GPU_MODEL" --tokenizer "$tokenizer" --device cuda ;;
    ipc)
        # The ipc tests are the authority: they clear or set what preflight's quick check said.
        if pytest_stage ipc 60 50 tests/gpu/test_cuda_ipc.py tests/gpu/test_copy_fence_cuda.py; then
            no_ipc=""
        else
            no_ipc="the ipc stage failed (see parts.log)"
        fi ;;
    kernels) pytest_stage kernels 60 50 tests/gpu/test_kernels_cuda.py ;;
    inprocess) pytest_stage inprocess 90 75 tests/gpu/test_triton_step.py "$graph_tests" -k "not daemon_restarts" ;;
    step) stage step 90 python3 benchmarks/gpu_step.py --quick --json "$out/gpu_step.json" ;;
    engine)
        needs_ipc engine 150 &&
            pytest_stage engine 150 120 tests/gpu/test_engine_cuda.py tests/gpu/test_offload_cuda.py "$restart_test" ;;
    e2e)
        needs_ipc e2e 90 && stage e2e 90 benchmarks/gpu_e2e.sh "$out/gpu_e2e.json" "$tokenizer" \
            --variants hf_generate,hf_continuous_batching,kvd --rounds 1 ;;
    e2e_large)
        needs_ipc e2e_large 120 && stage e2e_large 120 benchmarks/gpu_e2e.sh "$out/gpu_e2e_large.json" "$tokenizer" \
            --workload large --token-budget 2048 --max-num-seqs 256 --num-blocks 16384 \
            --variants hf_continuous_batching,kvd --rounds 1 ;;
    families) needs_ipc families 90 && pytest_stage families 90 80 tests/gpu/test_families_cuda.py ;;
    *) echo "unknown stage $name (preflight model ipc kernels inprocess step engine e2e e2e_large families)" >&2 ;;
    esac
done
rm -f "$out"/*.tmp # a JSON cut mid-write (the 8 files are all that come back)
python3 tests/gpu/summary.py "$out"
