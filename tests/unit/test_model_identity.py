"""A model's identity: digests of its config, weights and tokenizer; what the
daemon compares at attach; weight digests remembered across engine starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inference.model_identity import identify
from kvd.common.identity import ModelIdentity
from kvd.common.layout import CacheLayout
from kvd.config import DaemonConfig
from kvd.daemon import Daemon
from kvd.errors import PreconditionError

LAYOUT = CacheLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")


def folder_with(tmp_path: Path, name: str, weights: bytes, config: bytes = b'{"model_type": "llama"}') -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_bytes(config)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_bytes(b'{"vocab": 1}')
    return folder


def test_equal_files_are_one_model_and_any_file_tells_two_apart(tmp_path):
    one = identify(folder_with(tmp_path, "a", b"weights-1"), "llama")
    copy = identify(folder_with(tmp_path, "copy-of-a", b"weights-1"), "llama")
    assert one.differences(copy) == [] and one.fingerprint() == copy.fingerprint()  # the name is not compared
    tuned = identify(folder_with(tmp_path, "b", b"weights-2"), "llama")
    assert [d.split()[0:2] for d in one.differences(tuned)] == [["weights", "digest"]]
    configured = identify(folder_with(tmp_path, "c", b"weights-1", b'{"model_type": "llama", "x": 1}'), "llama")
    assert [d.split()[0:2] for d in one.differences(configured)] == [["config", "digest"]]
    assert one.fingerprint() != tuned.fingerprint() != configured.fingerprint()


def test_a_weight_digest_is_remembered_until_the_file_changes(tmp_path):
    folder = folder_with(tmp_path, "m", b"A" * 4096)
    memo = tmp_path / "digests"
    first = identify(folder, "llama", memo)
    weights = folder / "model.safetensors"
    stat = weights.stat()
    with weights.open("r+b") as f:  # same size, same inode, and the old times put back
        f.write(b"B" * 4096)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert identify(folder, "llama", memo).weights_digest == first.weights_digest  # remembered, not read
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert identify(folder, "llama", memo).weights_digest != first.weights_digest
    assert identify(folder, "llama").weights_digest != first.weights_digest  # without a memo: read


def test_a_folder_without_weights_is_refused(tmp_path):
    folder = folder_with(tmp_path, "m", b"")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weight files"):
        identify(folder, "llama")


def identity(weights: bytes) -> ModelIdentity:
    return ModelIdentity("m", "llama", b"c" * 32, weights * 32, b"t" * 32)


def test_the_daemon_takes_the_first_engines_model_and_refuses_another(tmp_path):
    daemon = Daemon(DaemonConfig(block_size=4, num_blocks=8, shm_dir=str(tmp_path), lease_s=5.0))
    try:
        daemon.attach("tool", LAYOUT)  # no model named: not checked, and names none
        daemon.attach("first", LAYOUT, model=identity(b"1"))
        daemon.attach("same model", LAYOUT, model=identity(b"1"))
        with pytest.raises(PreconditionError, match=r"not this cache's .*weights digest 313131313131 vs 323232323232"):
            daemon.attach("fine-tune", LAYOUT, model=identity(b"2"))
        assert len(daemon.sessions.sessions) == 3  # the refused one opened nothing
    finally:
        daemon.close()
