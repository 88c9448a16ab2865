"""Where each template is kept warm, and the rendezvous order that places keys on replicas.

Rendezvous (highest-random-weight) hashing ranks replicas by
``sha256(address ‖ key)``: every gateway ranks alike, and a replica that comes
or goes moves only the keys it ranks first. A template is pinned on one
replica (the keeper, ``gateway.keeper``, picks the first of its rendezvous
order whose daemon accepts the pin and records it here with ``place``);
until then, or while that replica is not a candidate, its home is the first
candidate of its rendezvous order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from gateway.replica_load import ReplicaState


def rendezvous(key: bytes, addresses: Iterable[str]) -> list[str]:
    """``addresses`` ranked for ``key``, best first."""
    return sorted(addresses, key=lambda a: hashlib.sha256(a.encode() + b"\0" + key).digest(), reverse=True)


class TemplatePlacement:
    """template (``tenant/name``) -> the replica it is pinned on.

    Not locked: its owner (the ``Router``) calls it under its own lock.
    """

    def __init__(self) -> None:
        self._placed: dict[str, str] = {}

    def place(self, template: str, address: str | None) -> None:
        """Records the replica ``template`` is pinned on (None: nowhere)."""
        if address is None:
            self._placed.pop(template, None)
        else:
            self._placed[template] = address

    def placed(self, template: str) -> str | None:
        return self._placed.get(template)

    def home(self, template: str, candidates: list[ReplicaState]) -> ReplicaState:
        """The candidate ``template`` is kept warm on: where it is pinned, else its rendezvous first."""
        by_address = {r.address: r for r in candidates}
        placed = self._placed.get(template)
        if placed in by_address:
            return by_address[placed]
        return by_address[rendezvous(template.encode(), by_address)[0]]
