"""Templates in a real Redis: the server at 127.0.0.1:6379 and an embedded one."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time

import pytest
import redis

from gateway.embedded_redis import EmbeddedRedis
from gateway.templates import StoreUnavailable, TemplateExists, TemplateNotFound, TemplateStore
from tests.conftest import wait_for


@pytest.fixture(scope="module", params=["server", "embedded"])
def store(request, tmp_path_factory):
    if request.param == "server":
        client = redis.Redis(host="127.0.0.1", port=6379)
        client.ping()
        prefix = f"kvd-test-{secrets.token_hex(4)}:"  # the shared server keeps nothing of this run
        yield TemplateStore(client, prefix=prefix)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
    else:
        embedded = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
        yield TemplateStore(embedded.start())
        embedded.stop()


@pytest.fixture
def tenant() -> str:
    return f"test-{secrets.token_hex(4)}"  # each test its own namespace


def test_create_get_update_delete(store, tenant):
    created = store.create(tenant, "support-bot", "You are a helpful bot.", [1, 2, 3], 0, "first")
    assert (created.name, created.token_ids, created.description, created.expire_time) == (
        "support-bot", [1, 2, 3], "first", None,
    )  # fmt: skip
    assert store.get(tenant, "support-bot").content == "You are a helpful bot."
    before = time.time()
    updated = store.update(tenant, "support-bot", ttl_seconds=100, description="second")
    assert updated.description == "second" and before + 99 <= updated.expire_time <= time.time() + 100
    assert store.update(tenant, "support-bot", ttl_seconds=0, description=None).expire_time is None
    store.delete(tenant, "support-bot")
    with pytest.raises(TemplateNotFound):
        store.get(tenant, "support-bot")
    with pytest.raises(TemplateNotFound):
        store.delete(tenant, "support-bot")


def test_names_are_unique_per_tenant_and_validated(store, tenant):
    store.create(tenant, "a", "x", [1], 0, "")
    with pytest.raises(TemplateExists):
        store.create(tenant, "a", "y", [2], 0, "")
    other = tenant + "-other"
    assert store.create(other, "a", "y", [2], 0, "").token_ids == [2]  # another tenant's namespace
    assert store.get(tenant, "a").token_ids == [1]
    for bad in ("", "Upper", "-dash", "a" * 129, "sp ace", "semi;colon"):
        with pytest.raises(ValueError, match="name: .* is not allowed"):
            store.create(tenant, bad, "x", [1], 0, "")
    with pytest.raises(ValueError, match="empty"):
        store.create(tenant, "empty", "", [], 0, "")
    with pytest.raises(ValueError, match="ttl"):
        store.create(tenant, "neg", "x", [1], -1, "")


def test_a_ttl_expires_the_template(store, tenant):
    store.create(tenant, "short", "x", [1], 1, "")
    assert store.exists(tenant, "short")
    assert wait_for(lambda: not store.exists(tenant, "short"), 30)  # Redis expires it after a second
    with pytest.raises(TemplateNotFound):
        store.get(tenant, "short")
    assert [t.name for t in store.list(tenant)[0]] == []


def test_listing_pages_in_name_order(store, tenant):
    names = [f"t{i:02d}" for i in range(7)]
    for name in reversed(names):
        store.create(tenant, name, f"content of {name}", [1, 2], 0, "")
    store.delete(tenant, "t03")
    pages, token = [], ""
    while True:
        page, token = store.list(tenant, page_size=3, page_token=token)
        pages.append([t.name for t in page])
        if not token:
            break
    assert pages == [["t00", "t01", "t02"], ["t04", "t05", "t06"]]


def test_an_unreachable_redis_is_reported():
    dead = TemplateStore(redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5))
    with pytest.raises(StoreUnavailable, match="Redis is unreachable"):
        dead.get("t", "x")


def test_concurrent_writers_never_expose_a_half_written_template(store, tenant):
    """Two stores (two gateways, each its own connection) create, update and
    delete one name as fast as they can while a third reads the raw hash: it
    is either absent or whole, and reads through the store never fail."""
    client = store.redis
    pool = client.connection_pool
    writers = [
        TemplateStore(
            redis.Redis(connection_pool=redis.ConnectionPool(pool.connection_class, **pool.connection_kwargs)),
            prefix=store.prefix,
        )
        for _ in range(2)
    ]
    key, stop, errors = f"{store.prefix}tpl:{tenant}:hot", threading.Event(), []
    whole = {b"content", b"token_ids", b"create_time", b"description", b"cached_tokens"}

    def write(writer: TemplateStore) -> None:
        while not stop.is_set():
            try:
                writer.create(tenant, "hot", "content " * 50, list(range(300)), 0, "d")
                writer.update(tenant, "hot", ttl_seconds=60, description="e")
                writer.delete(tenant, "hot")
            except (TemplateExists, TemplateNotFound):
                pass
            except Exception as exc:  # noqa: BLE001 - any other failure is the test's finding
                errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    for thread in threads:
        thread.start()
    seen_whole = reads = 0
    try:
        # A count of reads, not a time: as many races whatever the machine's speed.
        deadline = time.monotonic() + 120
        while (reads < 300 or not seen_whole) and time.monotonic() < deadline:
            reads += 1
            fields = client.hgetall(key)
            assert not fields or whole <= set(fields), f"a half-written template: {sorted(fields)}"
            seen_whole += bool(fields)
            with contextlib.suppress(TemplateNotFound):
                store.get(tenant, "hot")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors, errors
    assert seen_whole > 0  # the reader did meet templates, not only gaps


def test_debris_of_a_half_written_create_counts_as_absent(store, tenant):
    # What a gateway killed between the two writes of the old create left.
    store.redis.hset(f"{store.prefix}tpl:{tenant}:debris", "content", "x")
    store.redis.zadd(f"{store.prefix}tpl-index:{tenant}", {"debris": 0})
    with pytest.raises(TemplateNotFound):
        store.get(tenant, "debris")
    assert store.list(tenant) == ([], "")
    assert store.create(tenant, "debris", "y", [7], 0, "").token_ids == [7]
    assert store.get(tenant, "debris").content == "y"
