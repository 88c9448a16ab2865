"""Generates the Python protobuf/gRPC modules from the .proto sources.

Usage: ``python -m kvd_api.generate [OUT_DIR]`` (default: the protos/ folder
itself). The test suite runs it into a temporary folder and compares, so the
committed code cannot drift from its sources.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTOS_ROOT = Path(__file__).resolve().parent.parent


def proto_sources() -> list[Path]:
    return sorted(PROTOS_ROOT.glob("kvd_api/**/*.proto"))


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    for source in proto_sources():
        args = [
            "protoc",
            f"-I{PROTOS_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(source.relative_to(PROTOS_ROOT)),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {source}")
        # Every folder down to the module is a regular package.
        for folder in source.parent.relative_to(PROTOS_ROOT).parents[:-1]:
            (out_dir / folder / "__init__.py").touch()
        (out_dir / source.parent.relative_to(PROTOS_ROOT) / "__init__.py").touch()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTOS_ROOT)
