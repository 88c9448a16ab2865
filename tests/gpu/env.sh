# Sourced by the GPU scripts: the machine's own python3 and torch (no
# virtualenv) plus the small wheels its image lacks, carried in .whl/ at the
# repository root (tests/gpu/prepare.sh lists them), installed once per
# machine into a scratch folder (a stamp marks it done: the e2e stages source
# this again).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
site=/tmp/kvd-site
if compgen -G ".whl/*.whl" >/dev/null && [ ! -f "$site/.installed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl &&
        touch "$site/.installed"
fi
[ -d "$site" ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PWD:$PWD/protos${PYTHONPATH:+:$PYTHONPATH}"
# The allocator the cache's IPC export needs, in every process of the run (the
# daemon forces it on itself; tests export memory from their own process too).
# What the image preset is kept for preflight.json.
if [ -z "${KVD_GPU_PRESET_ALLOC_CONF+set}" ]; then
    export KVD_GPU_PRESET_ALLOC_CONF="PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF-(unset)} PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-(unset)}"
fi
unset PYTORCH_ALLOC_CONF
PYTORCH_CUDA_ALLOC_CONF=$(python3 -c 'from kvd.cli import ipc_allocator_conf; print(ipc_allocator_conf(None))')
export PYTORCH_CUDA_ALLOC_CONF
