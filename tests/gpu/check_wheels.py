"""Checks, here, that the wheels tests/gpu/prepare.sh carries to the GPU
machine will import there: each one's requirements must be met by another
carried wheel or by the GPU image's own packages, at the versions the image
has. A carried wheel that needs a newer huggingface-hub than the image's,
say, would break ``import transformers`` in every stage of the run.

    python tests/gpu/check_wheels.py WHEEL_DIR

Prints each requirement and how it is met, and the total size that travels;
exits 1 when one is not met.
"""

from __future__ import annotations

import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

#: The GPU image's versions, as read there (the device tool's KINDS.md, 2026-11).
IMAGE_VERSIONS = {
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "tokenizers": "0.23.2",
    "torch": "2.11.0",
    "triton": "3.6.0",
    "transformers": "5.17.0",
}
#: In the image's package list, at a version nobody read there.
IMAGE_NAMES = {"typing-extensions", "packaging", "pyyaml", "regex", "typer", "tqdm", "click", "filelock", "psutil",
               "grpcio", "protobuf", "xxhash"}  # fmt: skip
#: The GPU machine's interpreter (markers are evaluated for it).
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}  # fmt: skip


def metadata(wheel: Path) -> tuple[str, Version, list[Requirement]]:
    """A wheel's name, version and requirements (its extras' left out)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(archive.read(name).decode())
    requirements = [Requirement(r) for r in message.get_all("Requires-Dist") or []]
    wanted = [r for r in requirements if r.marker is None or r.marker.evaluate(TARGET)]
    return canonicalize_name(message["Name"]), Version(message["Version"]), wanted


def check(wheels: list[Path]) -> tuple[list[str], list[str]]:
    """(how each requirement is met, what is not met)."""
    carried = {name: (version, requirements) for name, version, requirements in map(metadata, wheels)}
    met = [
        f"{name} {version} replaces the image's {IMAGE_VERSIONS.get(name, '')}".rstrip()
        for name, (version, _) in sorted(carried.items())
        if name in IMAGE_VERSIONS or name in IMAGE_NAMES
    ]
    unmet = []
    for name, (_, requirements) in sorted(carried.items()):
        for requirement in requirements:
            needed = canonicalize_name(requirement.name)
            if needed in carried or needed in IMAGE_VERSIONS:
                where, version = ("carried", carried[needed][0]) if needed in carried else ("image", None)
                version = version or Version(IMAGE_VERSIONS[needed])
                line = f"{name} needs {requirement}: {where} {version}"
                (met if requirement.specifier.contains(version, prereleases=True) else unmet).append(line)
            elif needed in IMAGE_NAMES:
                met.append(f"{name} needs {requirement}: on the image (version not read there)")
            else:
                unmet.append(f"{name} needs {requirement}: neither carried nor on the image")
    return met, unmet


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    wheels = sorted(folder.glob("*.whl"))
    met, unmet = check(wheels)
    for line in met:
        print(f"  ok  {line}")
    for line in unmet:
        print(f"  NOT MET  {line}")
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 1e6:.1f} MB")
    return 1 if unmet else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
