"""What makes a cache's bytes meaningful beyond its layout: the model.

Two models with the same layout (layers, KV heads, head size, dtype) fill
blocks of the same shape with different numbers; a block computed by one is
garbage to the other, under the very same token hashes. So every engine tells
the daemon at attach which model it runs, by digests of what determines its
K/V (the config and the weights) and of what turns text into the token ids
blocks are keyed by (the tokenizer). The first engine names the cache's model;
one whose model differs is refused, naming what differs. Lower tiers that
outlive the daemon keep blocks under the same identity (``fingerprint``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

#: Fields that must match for two engines to share blocks (``name`` is only shown).
_COMPARED = ("model_type", "config_digest", "weights_digest", "tokenizer_digest")


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """A model as the daemon tells one from another.

    Attributes:
        name: how people call it (a folder name); shown, never compared.
        model_type: transformers' ``model_type`` (``llama``, ``gemma2``...).
        config_digest: SHA-256 of its ``config.json``.
        weights_digest: SHA-256 over its weight files' names and digests.
        tokenizer_digest: SHA-256 over its tokenizer files' names and digests.
    """

    name: str
    model_type: str
    config_digest: bytes
    weights_digest: bytes
    tokenizer_digest: bytes

    def differences(self, other: ModelIdentity) -> list[str]:
        """What differs from ``other``, one phrase per field (empty: the same model)."""
        found = []
        for name in _COMPARED:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                shown = (mine.hex()[:12], theirs.hex()[:12]) if isinstance(mine, bytes) else (mine, theirs)
                found.append(f"{name.replace('_', ' ')} {shown[0]} vs {shown[1]}")
        return found

    def fingerprint(self) -> str:
        """One hex digest of every compared field (for keys of what outlives a daemon)."""
        digest = hashlib.sha256(b"kvd/model-identity/v1")
        for name in _COMPARED:
            value = getattr(self, name)
            data = value if isinstance(value, bytes) else value.encode()
            digest.update(len(data).to_bytes(4, "little") + data)
        return digest.hexdigest()

    def describe(self) -> str:
        return f"{self.name} ({self.model_type}, weights {self.weights_digest.hex()[:12]})"
