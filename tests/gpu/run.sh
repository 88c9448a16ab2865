#!/usr/bin/env bash
# Runs the tests marked `gpu` on a CUDA machine, with that machine's own
# python3 and torch (no virtualenv). Small packages its image lacks
# (grpcio-health-checking, grpcio-reflection, a recent protobuf) can be put
# as wheels in .whl/ at the repository root; they are installed to a scratch
# folder first.
set -euo pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvd-site .whl/*.whl
    export PYTHONPATH="/tmp/kvd-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PWD/protos${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,uuid,memory.total --format=csv || true
exec python3 -m pytest -m gpu tests/gpu -v -p no:cacheprovider "$@"
