#!/usr/bin/env bash
# Fills, on this (CPU) machine, what the GPU check carries to the GPU machine,
# which has no internet (both folders are git-ignored):
#   .whl/           wheels of what its image lacks or has in other versions:
#                   grpcio, grpcio-health-checking, grpcio-reflection and
#                   protobuf (the generated code's minimum versions),
#                   transformers and xxhash (the disk tier's checksum), each the version in .venv (so the baselines
#                   run the same code as on the CPU); about 25 MB
#   .gpu/tokenizer  SmolLM2's tokenizer files (the e2e workload's real text
#                   tokenizes as on the CPU only with them); about 3.5 MB
# Then it checks the wheels against the GPU image (tests/gpu/check_wheels.py)
# and prints what travels. See tests/gpu/run.sh's header for the device call.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
py=.venv/bin/python
packages=$($py - <<'PY'
import importlib.metadata as m
names = ["grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "transformers", "xxhash"]
print(" ".join(f"{n}=={m.version(n)}" for n in names))
PY
)
rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# shellcheck disable=SC2086
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl $packages
$py - <<'PY'
import shutil
from pathlib import Path

from inference import model_store
from tests.gpu.random_llama import TOKENIZER_FILES

source = model_store.resolve_model("smollm2", model_store.default_cache_dir())
target = Path(".gpu/tokenizer")
target.mkdir(parents=True, exist_ok=True)
for name in TOKENIZER_FILES:
    if (source / name).exists():
        shutil.copyfile(source / name, target / name)
PY
ls .whl .gpu/tokenizer
# Each wheel's requirements met by another carried wheel or by the GPU image's
# own packages (a wheel needing a newer huggingface-hub, say, would break
# every import of transformers there).
$py tests/gpu/check_wheels.py .whl
# What travels: the tree (tracked and untracked files git does not ignore) and the two carried folders.
tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
carried=$(du -sb .whl .gpu | awk '{s += $1} END {print s}')
echo "travels: $(((tree + carried) / 1000000)) MB of the 64 MiB (tree $((tree / 1000000)) MB, .whl + .gpu $((carried / 1000000)) MB)"
