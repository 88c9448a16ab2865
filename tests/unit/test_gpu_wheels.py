"""tests/gpu/check_wheels.py: a carried wheel whose requirement the GPU image
would not meet is caught here, before a GPU run fails on its first import."""

from __future__ import annotations

import zipfile

from tests.gpu import check_wheels


def wheel(folder, name: str, version: str, *requires: str):
    path = folder / f"{name}-{version}-py3-none-any.whl"
    lines = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_requirements_met_by_carried_wheels_or_the_image_pass(tmp_path):
    wheels = [
        wheel(tmp_path, "grpcio", "1.85.3", "typing-extensions~=4.12"),
        wheel(tmp_path, "grpcio-reflection", "1.85.1", "grpcio>=1.85.1", 'pytest; extra == "dev"'),
        wheel(tmp_path, "transformers", "5.24.0", "huggingface-hub<3.0,>=1.31.0", 'colorama; sys_platform == "win32"'),
    ]
    met, unmet = check_wheels.check(wheels)
    assert unmet == []
    assert met == [
        "grpcio 1.85.3 replaces the image's",
        "transformers 5.24.0 replaces the image's 5.17.0",
        "grpcio needs typing-extensions~=4.12: on the image (version not read there)",
        "grpcio-reflection needs grpcio>=1.85.1: carried 1.85.3",
        "transformers needs huggingface-hub<3.0,>=1.31.0: image 1.33.0",
    ]


def test_a_requirement_the_image_does_not_meet_is_named(tmp_path):
    wheels = [
        wheel(tmp_path, "transformers", "6.1.0", "huggingface-hub>=2.0", "tokenizers<0.24"),
        wheel(tmp_path, "grpcio-health-checking", "1.90.0", "grpcio>=1.90", "sentencepiece-ng"),
        wheel(tmp_path, "grpcio", "1.85.3"),
    ]
    _, unmet = check_wheels.check(wheels)
    assert unmet == [
        "grpcio-health-checking needs grpcio>=1.90: carried 1.85.3",
        "grpcio-health-checking needs sentencepiece-ng: neither carried nor on the image",
        "transformers needs huggingface-hub>=2.0: image 1.33.0",
    ]
