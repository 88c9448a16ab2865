"""The digests that name a model folder to the daemon (``kvd.common.identity``).

Hashing a model's weights reads every byte of them (about 0.6 s per 500 MB
here), so a file's digest is remembered beside the converted models, keyed
by its path, size, modification time and inode: an engine restarted on the
same files reads nothing but the config and the tokenizer again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from kvd.common.identity import ModelIdentity

log = logging.getLogger("inference.model_identity")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json",
)  # fmt: skip


def identify(folder: Path, model_type: str, digest_cache: Path | None = None) -> ModelIdentity:
    """The identity of the model in ``folder`` (a folder from ``model_store.resolve_model``).

    Args:
        digest_cache: where weight files' digests are remembered (None: nowhere).
    """
    weights = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not weights:
        raise ValueError(f"model folder {folder} has no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    tokenizer = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    return ModelIdentity(
        name=folder.name,
        model_type=model_type,
        config_digest=_file_digest(folder / "config.json"),
        weights_digest=_files_digest(weights, digest_cache),
        tokenizer_digest=_files_digest(tokenizer, None),
    )


def _files_digest(paths: list[Path], digest_cache: Path | None) -> bytes:
    combined = hashlib.sha256()
    for path in paths:
        name = path.name.encode()
        combined.update(len(name).to_bytes(4, "little") + name + _remembered_digest(path, digest_cache))
    return combined.digest()


def _remembered_digest(path: Path, digest_cache: Path | None) -> bytes:
    if digest_cache is None:
        return _file_digest(path)
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    memo = digest_cache / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
    try:
        return bytes.fromhex(json.loads(memo.read_text())["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    digest = _file_digest(path)
    try:
        digest_cache.mkdir(parents=True, exist_ok=True)
        staging = memo.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps({"file": str(path), "sha256": digest.hex()}))
        staging.replace(memo)
    except OSError as err:  # a read-only cache only costs the next start the hashing again
        log.warning("could not remember a weight file's digest", extra={"file": str(path), "error": str(err)})
    return digest


def _file_digest(path: Path) -> bytes:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").digest()
