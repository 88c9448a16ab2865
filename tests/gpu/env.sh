# Sourced by the GPU scripts: the machine's own python3 and torch (no
# virtualenv) plus the small wheels its image lacks, carried in .whl/ at the
# repository root (grpcio, grpcio-health-checking, grpcio-reflection and
# protobuf of the versions in .venv; transformers too, so that the baselines
# are the same code as on the CPU), installed to a scratch folder.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvd-site .whl/*.whl
    export PYTHONPATH="/tmp/kvd-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PWD/protos${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,uuid,memory.total --format=csv || true
