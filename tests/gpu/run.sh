#!/usr/bin/env bash
# Runs the tests marked `gpu` on a CUDA machine (see env.sh for the packages).
set -euo pipefail
source "$(dirname "$0")/env.sh"
exec python3 -m pytest -m gpu tests/gpu -v -p no:cacheprovider "$@"
