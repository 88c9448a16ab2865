"""Named prefix templates, kept in Redis, one namespace per tenant.

Key schema (``kvd:`` is the configurable prefix, ``{t}`` the tenant, ``{n}``
the template name)::

    kvd:tpl:{t}:{n}     hash   content, messages (a chat template's, JSON
                               [[role, content], ...]), token_ids (uint32 LE
                               bytes), description, create_time, cached_tokens;
                               Redis expiry = the TTL
    kvd:tpl-index:{t}   zset   every name of the tenant (score 0), for listing
                               in name order; entries whose hash expired are
                               dropped lazily as listings meet them
    kvd:tpl-warm        set    "{t}/{n}" of every template whose blocks are
                               (to be) pinned on the engines; a member whose
                               hash is gone (expired, deleted) is unpinned and
                               removed by the gateway's sweep

A template's tokens are computed once (by the engine's tokenizer) when it is
created; its content never changes (a new content is a new name), so its
create time names its content: a name deleted and created again has a new one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import redis

from gateway.template_scripts import TemplateScripts
from gateway.tenants import LimitExceeded, TenantLimits
from kvd.common.field_error import FieldError

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
MAX_PAGE_SIZE = 500
DEFAULT_PAGE_SIZE = 50
MAX_TTL_S = 10 * 365 * 24 * 3600
MAX_DESCRIPTION = 1024


class TemplateNotFound(LookupError):
    pass


class TemplateExists(Exception):
    pass


class StoreUnavailable(Exception):
    """Redis cannot be reached."""


@dataclass(frozen=True)
class Template:
    tenant: str
    name: str
    content: str
    token_ids: list[int]
    description: str
    create_time: float
    expire_time: float | None  # seconds since the epoch; None: never
    cached_tokens: int
    messages: tuple[tuple[str, str], ...] = ()  # a chat template's (role, content); empty: a text template


class TemplatePage(NamedTuple):
    """One page of a listing, and the token of the next page ("" at the end)."""

    templates: list[Template]
    next_page_token: str


def check_name(name: str, field: str = "name") -> None:
    if not NAME.match(name):
        raise FieldError(
            field, f"{field}: {name[:200]!r} is not allowed as a template name: use [a-z0-9][a-z0-9._-]{{0,127}}"
        )


def check_ttl(ttl_seconds: int) -> None:
    if not 0 <= ttl_seconds <= MAX_TTL_S:
        raise FieldError("ttl_seconds", f"ttl_seconds must be in [0, {MAX_TTL_S}] (0: no expiry), got {ttl_seconds}")


def check_description(description: str) -> None:
    if len(description) > MAX_DESCRIPTION:
        raise FieldError("description", f"description is {len(description)} characters; at most {MAX_DESCRIPTION}")


class TemplateStore:
    """Templates in one Redis database.

    Every method raises ``StoreUnavailable`` when Redis cannot be reached.
    """

    def __init__(self, client: redis.Redis, prefix: str = "kvd:") -> None:
        self.redis = client
        self.prefix = prefix
        self._page_secret: bytes | None = None
        self._scripts = TemplateScripts(client)

    def _key(self, tenant: str, name: str) -> str:
        return f"{self.prefix}tpl:{tenant}:{name}"

    def _index(self, tenant: str) -> str:
        return f"{self.prefix}tpl-index:{tenant}"

    @property
    def _warm(self) -> str:
        return f"{self.prefix}tpl-warm"

    def create(
        self,
        tenant: str,
        name: str,
        content: str,
        token_ids: Sequence[int],
        ttl_seconds: int,
        description: str,
        limits: TenantLimits | None = None,
        pin_blocks: int = 0,
        messages: Sequence[tuple[str, str]] = (),
    ) -> Template:
        """Stores a new template (``pin_blocks``: the blocks it will pin).

        Raises:
            FieldError: a bad name, empty content or a negative TTL.
            TemplateExists: the tenant already has this name.
            LimitExceeded: past the tenant's template or pinned-block limit.
        """
        check_name(name)
        check_ttl(ttl_seconds)
        if not (content or messages) or not token_ids:
            raise FieldError("content", "template content must not be empty")
        limits = limits or TenantLimits()
        fields = {
            "content": content,
            "token_ids": array("I", token_ids).tobytes(),
            "description": description,
            "create_time": repr(time.time()),
            "cached_tokens": 0,
            "pin_blocks": pin_blocks,
        }
        if messages:
            fields["messages"] = json.dumps([list(m) for m in messages])
        pairs = [x for item in fields.items() for x in item]
        args = [name, ttl_seconds, limits.max_templates, limits.max_pinned_blocks, pin_blocks, self._key(tenant, "")]
        with self._redis():
            created = self._scripts.create(keys=[self._key(tenant, name), self._index(tenant)], args=[*args, *pairs])
        if created == 0:
            raise TemplateExists(f"template {name!r} already exists")
        if created == -1:
            raise LimitExceeded(f"max_templates: tenant {tenant!r} has {limits.max_templates} templates (the limit)")
        if created == -2:
            raise LimitExceeded(
                f"max_pinned_blocks: this template's {pin_blocks} blocks would take tenant {tenant!r} past its "
                f"limit of {limits.max_pinned_blocks} pinned blocks"
            )
        return self.get(tenant, name)

    def get(self, tenant: str, name: str) -> Template:
        with self._redis() as r:
            pipe = r.pipeline()
            pipe.hgetall(self._key(tenant, name))
            pipe.pttl(self._key(tenant, name))
            fields, ttl_ms = pipe.execute()
        if b"token_ids" not in fields:  # none, or debris of an old half-written create
            raise TemplateNotFound(f"template {name!r} not found")
        return _template(tenant, name, fields, ttl_ms)

    def create_time(self, tenant: str, name: str) -> float:
        """The create time alone (one small read): it changes when the name
        holds another content, so it tells whether a copy is current."""
        with self._redis() as r:
            stamp = r.hget(self._key(tenant, name), "create_time")
        if stamp is None:
            raise TemplateNotFound(f"template {name!r} not found")
        return float(stamp)

    def set_cached_tokens(self, tenant: str, name: str, cached_tokens: int) -> None:
        with self._redis():
            self._scripts.set_if_present(keys=[self._key(tenant, name)], args=["cached_tokens", cached_tokens])

    def update(self, tenant: str, name: str, ttl_seconds: int | None, description: str | None) -> Template:
        if ttl_seconds is not None:
            check_ttl(ttl_seconds)
        ttl = "keep" if ttl_seconds is None else str(ttl_seconds)
        with self._redis():
            args = [ttl, description or "", "keep" if description is None else "set"]
            if not self._scripts.update(keys=[self._key(tenant, name)], args=args):
                raise TemplateNotFound(f"template {name!r} not found")
        return self.get(tenant, name)

    def delete(self, tenant: str, name: str) -> None:
        with self._redis():
            deleted = self._scripts.delete(keys=[self._key(tenant, name), self._index(tenant)], args=[name])
        if not deleted:
            raise TemplateNotFound(f"template {name!r} not found")

    def list(self, tenant: str, page_size: int = 0, page_token: str = "") -> TemplatePage:
        """A page of templates in name order."""
        if page_size < 0:
            raise FieldError("page_size", f"page_size must be >= 0, got {page_size}")
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        start = f"({self._after(tenant, page_token)}" if page_token else "-"
        found: list[Template] = []
        with self._redis() as r:
            while len(found) < size:
                names = [n.decode() for n in r.zrangebylex(self._index(tenant), start, "+", 0, size - len(found))]
                if not names:
                    return TemplatePage(found, "")
                for name in names:
                    try:
                        found.append(self.get(tenant, name))
                    except TemplateNotFound:  # expired: drop it from the index
                        r.zrem(self._index(tenant), name)
                start = f"({names[-1]}"
            more = r.zrangebylex(self._index(tenant), start, "+", 0, 1)
        return TemplatePage(found, self._page_token(tenant, found[-1].name) if more else "")

    # NOTE: a page token is the last name of its page, signed with a key kept
    # in Redis (shared by every gateway on it): a token no listing produced,
    # or one of another tenant, is refused rather than read as a position.
    def _page_token(self, tenant: str, last_name: str) -> str:
        return f"{last_name}.{self._signature(tenant, last_name)}"

    def _after(self, tenant: str, page_token: str) -> str:
        last_name, _, signature = page_token.rpartition(".")
        if not (NAME.match(last_name) and hmac.compare_digest(signature, self._signature(tenant, last_name))):
            raise FieldError("page_token", "page_token: not a token from a previous ListTemplates page")
        return last_name

    def _signature(self, tenant: str, last_name: str) -> str:
        message = f"{tenant}\0{last_name}".encode()
        return hmac.new(self._page_key(), message, hashlib.sha256).hexdigest()[:32]

    def _page_key(self) -> bytes:
        if self._page_secret is None:
            key = f"{self.prefix}page-token-key"
            with self._redis() as r:
                r.set(key, secrets.token_bytes(32), nx=True)  # the first gateway's key is everyone's
                self._page_secret = r.get(key)
        return self._page_secret

    def count(self, tenant: str) -> int:
        with self._redis() as r:
            return r.zcard(self._index(tenant))

    def exists(self, tenant: str, name: str) -> bool:
        with self._redis() as r:
            return bool(r.hexists(self._key(tenant, name), "token_ids"))

    def ping(self) -> None:
        with self._redis() as r:
            r.ping()

    # ------------------------------------------------- templates kept warm

    def mark_warm(self, tenant: str, name: str) -> None:
        """Records that the template's blocks are pinned on the engines."""
        with self._redis() as r:
            r.sadd(self._warm, warm_member(tenant, name))

    def warm_members(self) -> list[str]:
        with self._redis() as r:
            return sorted(m.decode() for m in r.smembers(self._warm))

    def unmark_warm(self, member: str) -> None:
        with self._redis() as r:
            r.srem(self._warm, member)

    def live(self, members: Sequence[str]) -> list[bool]:
        """For each warm-set member, whether its template still exists."""
        with self._redis() as r:
            pipe = r.pipeline()
            for member in members:
                pipe.hexists(self._key(*split_warm_member(member)), "token_ids")
            return [bool(n) for n in pipe.execute()]

    def _redis(self):
        return _Guard(self.redis)


def warm_member(tenant: str, name: str) -> str:
    return f"{tenant}/{name}"


def split_warm_member(member: str) -> tuple[str, str]:
    tenant, _, name = member.rpartition("/")
    return tenant, name


class _Guard:
    """Turns connection failures into StoreUnavailable."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def __enter__(self) -> redis.Redis:
        return self.client

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, redis.ConnectionError | redis.TimeoutError):
            raise StoreUnavailable(f"Redis is unreachable: {exc}") from exc


def _template(tenant: str, name: str, fields: dict[bytes, bytes], ttl_ms: int) -> Template:
    tokens = array("I")
    tokens.frombytes(fields[b"token_ids"])
    return Template(
        tenant=tenant,
        name=name,
        content=fields[b"content"].decode(),
        token_ids=tokens.tolist(),
        description=fields.get(b"description", b"").decode(),
        create_time=float(fields[b"create_time"]),
        expire_time=time.time() + ttl_ms / 1000 if ttl_ms > 0 else None,
        cached_tokens=int(fields.get(b"cached_tokens", b"0")),
        messages=tuple((role, content) for role, content in json.loads(fields.get(b"messages", b"[]"))),
    )
