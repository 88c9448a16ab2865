"""Templates kept in the gateway's memory, checked against Redis per use.

A templated request needs the template's token ids; reading the whole hash
(a few KiB of ids) per request costs more than the request's own tokenizing.
The cache keeps each template it read and, per use, reads only its create
time (``TemplateStore.create_time``): content never changes under a name, so
the same create time means the same content, and a template deleted, expired
or created again (by this gateway or any other sharing the Redis) is noticed
at its next use.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from gateway.templates import Template, TemplateStore


class TemplateCache:
    """Args:
    store: where templates live.
    capacity: templates kept (least recently used dropped first).
    """

    def __init__(self, store: TemplateStore, capacity: int = 1024) -> None:
        self.store = store
        self.capacity = capacity
        self._kept: OrderedDict[tuple[str, str], Template] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, tenant: str, name: str) -> Template:
        """The current template.

        Raises:
            TemplateNotFound: it does not exist (any more).
            StoreUnavailable: Redis cannot be reached.
        """
        key = (tenant, name)
        create_time = self.store.create_time(tenant, name)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None and kept.create_time == create_time:
                self._kept.move_to_end(key)
                return kept
        template = self.store.get(tenant, name)
        with self._lock:
            self._kept[key] = template
            self._kept.move_to_end(key)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        return template
