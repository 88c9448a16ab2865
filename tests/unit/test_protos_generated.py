"""The committed protobuf code is exactly what `make protos` generates."""

from __future__ import annotations

from pathlib import Path

from kvd_api.generate import PROTOS_ROOT, generate, proto_sources


def test_generated_code_matches_the_proto_sources(tmp_path: Path):
    generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert generated, "protoc generated nothing"
    assert len(generated) == 3 * len(proto_sources())
    stale = [str(rel) for rel in generated if (PROTOS_ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"generated code is stale, run `make protos`: {stale}"
    committed = sorted(p.relative_to(PROTOS_ROOT) for p in PROTOS_ROOT.rglob("*_pb2*.py*"))
    assert committed == generated, "generated files without a .proto source (or missing ones)"
