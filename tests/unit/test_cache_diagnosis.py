"""Why a prompt missed the cache: the prompt history's divergences, the
diagnosis built from them and a request's usage, and the per-tenant metrics."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from gateway import cache_diagnosis
from gateway.cache_diagnosis import Divergence, PromptHistory, cached_runs, common_prefix, diagnosis
from gateway.http_api.metrics import HttpMetrics
from kvd.common.grpc_server import OpenCalls
from kvd_api.daemon.v1 import daemon_pb2 as dpb
from kvd_api.gateway.v1 import gateway_pb2 as pb

SALT = b"acme"
SYSTEM = list(range(1000, 1100))  # a long system prompt shared by every request


def prompt(stamp: int, question: int) -> list[int]:
    """The system prompt with a "timestamp" line near its top, then a question."""
    return SYSTEM[:10] + [7, stamp, 8] + SYSTEM[10:] + [question, question + 1]


def spaced(ids) -> str:
    return " ".join(map(str, ids))


# ------------------------------------------------------------ PromptHistory


def test_first_prompt_has_no_earlier():
    assert PromptHistory().observe(SALT, [1, 2, 3]) is None


def test_divergence_at_the_changed_timestamp():
    history = PromptHistory()
    history.observe(SALT, prompt(stamp=42, question=5))
    found = history.observe(SALT, prompt(stamp=43, question=5))
    assert found.common_tokens == 11  # the stamp's position
    assert list(found.earlier) == prompt(stamp=42, question=5)


def test_the_closest_earlier_prompt_is_chosen():
    history = PromptHistory()
    history.observe(SALT, prompt(stamp=42, question=5))
    history.observe(SALT, prompt(stamp=43, question=5))
    history.observe(SALT, [9, 9, 9])  # the newest, sharing nothing
    found = history.observe(SALT, prompt(stamp=43, question=6))
    assert found.common_tokens == len(prompt(43, 6)) - 2  # where the questions differ
    assert list(found.earlier) == prompt(stamp=43, question=5)


def test_a_tie_keeps_the_most_recent():
    history = PromptHistory()
    history.observe(SALT, [1, 2, 3, 4])
    history.observe(SALT, [1, 2, 5, 6])
    found = history.observe(SALT, [1, 2, 7])
    assert found.common_tokens == 2
    assert list(found.earlier) == [1, 2, 5, 6]


def test_identical_prompt_is_kept_once_and_moved_to_newest():
    history = PromptHistory()
    history.observe(SALT, [1, 2, 3])
    history.observe(SALT, [1, 2, 4])
    found = history.observe(SALT, [1, 2, 3])
    assert found.common_tokens == 3
    assert list(found.earlier) == [1, 2, 3]
    assert len(history) == 2
    tie = history.observe(SALT, [1, 2, 9])  # both share 2 tokens: [1, 2, 3] is now the newest
    assert list(tie.earlier) == [1, 2, 3]


def test_a_prompt_extending_an_earlier_one():
    history = PromptHistory()
    history.observe(SALT, [1, 2, 3])
    found = history.observe(SALT, [1, 2, 3, 4, 5])  # a conversation's next turn
    assert found.common_tokens == 3
    assert list(found.earlier) == [1, 2, 3]
    shorter = history.observe(SALT, [1, 2])
    assert shorter.common_tokens == 2


def test_salts_are_never_compared():
    history = PromptHistory()
    history.observe(b"acme", [1, 2, 3])
    assert history.observe(b"globex", [1, 2, 3]) is None
    assert history.observe(b"acme\x00sub", [1, 2, 3]) is None  # a per-request sub-salt
    assert history.observe(b"acme", [1, 2, 3]).common_tokens == 3


def test_per_salt_bound_keeps_the_newest():
    history = PromptHistory(per_salt=3)
    for i in range(5):
        history.observe(SALT, [i, 100])
    assert len(history) == 3
    assert history.observe(SALT, [1, 100]).common_tokens == 0  # [1, 100] was dropped
    assert history.observe(SALT, [4, 100]).common_tokens == 2


def test_max_salts_drops_the_least_recently_used():
    history = PromptHistory(max_salts=2)
    history.observe(b"a", [1])
    history.observe(b"b", [1])
    history.observe(b"a", [2])  # "a" used again: "b" is the least recent
    history.observe(b"c", [1])
    assert history.salts() == 2
    assert history.observe(b"b", [1]) is None  # dropped; back now, it pushes "a" out
    assert history.observe(b"c", [1]).common_tokens == 1
    assert history.observe(b"a", [2]) is None


def test_the_callers_list_is_copied():
    history = PromptHistory()
    ids = [1, 2, 3]
    history.observe(SALT, ids)
    ids[0] = 99
    assert history.observe(SALT, [1, 2, 3]).common_tokens == 3


def test_observe_from_many_threads():
    history = PromptHistory(per_salt=4, max_salts=8)

    def work(t: int) -> None:
        for i in range(200):
            history.observe(bytes([t % 10]), [t, i % 7, i])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert history.salts() <= 8
    assert len(history) <= 8 * 4


@pytest.mark.parametrize(
    ("a", "b", "common"),
    [([], [], 0), ([1], [], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([5, 2], [1, 2], 0)],
)
def test_common_prefix(a, b, common):
    assert common_prefix(np.array(a, dtype=np.int32), np.array(b, dtype=np.int32)) == common


# ------------------------------------------------------------ diagnosis


def test_runs_by_tier_in_prompt_order():
    usage = pb.Usage(
        prompt_tokens=200, cached_prompt_tokens=160, host_cached_prompt_tokens=96, disk_cached_prompt_tokens=32
    )
    assert [(r.tier, r.first_token, r.num_tokens) for r in cached_runs(usage)] == [
        (dpb.TIER_DEVICE, 0, 64),
        (dpb.TIER_HOST, 64, 64),
        (dpb.TIER_DISK, 128, 32),
    ]


def test_empty_runs_are_left_out():
    host_only = pb.Usage(prompt_tokens=100, cached_prompt_tokens=64, host_cached_prompt_tokens=64)
    assert [(r.tier, r.first_token, r.num_tokens) for r in cached_runs(host_only)] == [(dpb.TIER_HOST, 0, 64)]
    assert cached_runs(pb.Usage(prompt_tokens=100)) == []


def test_diagnosis_without_an_earlier_prompt():
    ids = [1, 2, 3, 4]
    d = diagnosis(ids, None, pb.Usage(prompt_tokens=4, cached_prompt_tokens=0), spaced)
    assert (d.prompt_tokens, d.cached_tokens, d.has_earlier) == (4, 0, False)
    assert not d.cached_runs and not d.text_before


def test_diagnosis_at_the_changed_timestamp():
    history = PromptHistory()
    history.observe(SALT, prompt(stamp=42, question=5))
    ids = prompt(stamp=43, question=5)
    found = history.observe(SALT, ids)
    usage = pb.Usage(prompt_tokens=len(ids), cached_prompt_tokens=0)
    d = diagnosis(ids, found, usage, spaced, window=4)
    assert d.prompt_tokens == len(ids)
    assert d.has_earlier and d.common_tokens == 11
    assert (d.token, d.earlier_token) == (43, 42)
    assert d.text_before == "1007 1008 1009 7"
    assert d.text_after == "43 8 1010 1011"
    assert d.earlier_text_after == "42 8 1010 1011"


def test_diagnosis_of_an_identical_prompt():
    ids = [1, 2, 3]
    found = Divergence(3, list(ids))
    d = diagnosis(ids, found, pb.Usage(prompt_tokens=3, cached_prompt_tokens=2), spaced)
    assert (d.common_tokens, d.token, d.earlier_token) == (3, -1, -1)
    assert d.text_before == "1 2 3"
    assert d.text_after == d.earlier_text_after == ""
    assert [(r.tier, r.first_token, r.num_tokens) for r in d.cached_runs] == [(dpb.TIER_DEVICE, 0, 2)]


def test_diagnosis_of_an_extended_prompt():
    history = PromptHistory()
    history.observe(SALT, [1, 2, 3])
    ids = [1, 2, 3, 4, 5]
    d = diagnosis(ids, history.observe(SALT, ids), pb.Usage(prompt_tokens=5), spaced)
    assert (d.common_tokens, d.token, d.earlier_token) == (3, 4, -1)
    assert (d.text_after, d.earlier_text_after) == ("4 5", "")


def test_decode_gets_python_ints():
    seen = []

    def decode(ids):
        seen.extend(type(i) for i in ids)
        return ""

    history = PromptHistory()
    history.observe(SALT, [1, 2, 3])
    ids = [1, 2, 4]
    diagnosis(ids, history.observe(SALT, ids), pb.Usage(), decode)
    assert seen and set(seen) == {int}


# ------------------------------------------------------------ metrics


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    cache_diagnosis.register(registry)
    return registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_record_moves_the_metrics(registry):
    tenant = "test-record"
    usage = pb.Usage(prompt_tokens=1000, cached_prompt_tokens=768)
    cache_diagnosis.record(tenant, usage, Divergence(300, [1]))
    cache_diagnosis.record(tenant, pb.Usage(prompt_tokens=24), None)
    assert value(registry, "kvd_gateway_prompt_tokens_total", tenant=tenant) == 1024
    assert value(registry, "kvd_gateway_cached_prompt_tokens_total", tenant=tenant) == 768
    diverged = "kvd_gateway_prompt_diverged_at_tokens"
    assert value(registry, f"{diverged}_count", tenant=tenant) == 1
    assert value(registry, f"{diverged}_sum", tenant=tenant) == 300
    assert value(registry, f"{diverged}_bucket", tenant=tenant, le="256.0") == 0
    assert value(registry, f"{diverged}_bucket", tenant=tenant, le="512.0") == 1


def test_tenants_are_counted_apart(registry):
    cache_diagnosis.record("test-a", pb.Usage(prompt_tokens=10, cached_prompt_tokens=5), None)
    assert value(registry, "kvd_gateway_prompt_tokens_total", tenant="test-b") == 0
    assert value(registry, "kvd_gateway_prompt_tokens_total", tenant="test-a") == 10


def test_the_http_registry_serves_them():
    metrics = HttpMetrics(OpenCalls(4, "--max-open-requests"))
    cache_diagnosis.record("test-http", pb.Usage(prompt_tokens=8, cached_prompt_tokens=8), Divergence(8, [1]))
    assert value(metrics.registry, "kvd_gateway_cached_prompt_tokens_total", tenant="test-http") == 8
