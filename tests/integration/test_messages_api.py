"""Anthropic's Messages API and explicit caching through the gateway, as the
``anthropic`` client calls them: greedy replies equal to ``generate`` on the
rendered prompt (sync, async, streamed), ``cache_control`` marks that create
then read a prefix, hold it under pool pressure while their TTL lasts and let
it go after, marks over the tenant's quota served and reported, tenants
never reading each other's marked blocks, a 1h mark that outlives an engine
restart (and, with the disk tier, a daemon SIGKILL), the cache diagnosis
naming where a system prompt's timestamp changed, errors in Anthropic's
shape, and ``count_tokens``.

One stack for most of the module: a daemon of 256 blocks of 16 tokens, a
float64 engine on the real SmolLM2, a gateway on the real Redis with keys of
two tenants, 5m marks shortened to a few seconds (``--cache-ttl-5m-s``) and
a pin quota per tenant (``--max-pinned-blocks``)."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import anthropic
import httpx2 as httpx
import openai
import pytest

from gateway.client import GatewayClient
from kvd.common.client import DaemonClient
from kvd_api.gateway.v1 import gateway_pb2 as pb
from tests.conftest import http_stack, wait_for
from tests.integration.engine_client import reference_greedy

BLOCK = 16
TTL_5M_S = 4
QUOTA_BLOCKS = 120
KEYS = {"acme-key": "acme", "globex-key": "globex"}
NEW_TOKENS = 12
GREEDY = {"temperature": 0.0}
FILLER = (
    "ACME Corp sells anvils, rockets, giant magnets and portable holes. Every order ships within two days, "
    "insured, to any country; returns are free for thirty days and repairs are free for a year. "
)


def system_prompt(tokens: int, tokenizer, nonce: str = "") -> str:
    """A support system prompt of about ``tokens`` tokens, unique by ``nonce`` (first, so no prefix is shared)."""
    text = f"Session {nonce or secrets.token_hex(4)}. You are ACME's support assistant. "
    while len(tokenizer.encode(text)) < tokens:
        text += FILLER
    return text


@pytest.fixture(scope="module")
def stack(model_dir):
    folder = tempfile.mkdtemp(prefix="kvd-msg-", dir="/tmp")
    with open(f"{folder}/keys.json", "w") as f:
        json.dump({"keys": [{"key": k, "tenant": t, "scopes": ["generate"]} for k, t in KEYS.items()]}, f)
    daemon = ["--block-size", str(BLOCK), "--num-blocks", "256", "--lease-s", "2", "--max-pinned-fraction", "0.9"]
    gateway = ["--api-keys", f"{folder}/keys.json", "--cache-ttl-5m-s", str(TTL_5M_S),
               "--max-pinned-blocks", str(QUOTA_BLOCKS)]  # fmt: skip
    with http_stack(model_dir, daemon, ["--dtype", "float64"], gateway, folder, api_key="acme-key") as s:
        yield s


def base_url(stack) -> str:
    return stack.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def client(stack):
    return anthropic.Anthropic(base_url=base_url(stack), api_key="acme-key", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(stack):
    reply = httpx.get(f"{stack.base_url}/models", headers={"authorization": "Bearer acme-key"})
    return reply.json()["data"][0]["id"]


def pins(stack) -> tuple[int, int]:
    """(pins, pinned blocks) in the daemon."""
    with DaemonClient.connect(stack.daemon.address) as daemon:
        stats = daemon.stats()
    return stats.num_pins, stats.num_pinned_blocks


def rendered(tokenizer, system: str | None, messages: list[dict]) -> list[int]:
    turns = ([{"role": "system", "content": system}] if system else []) + messages
    return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)["input_ids"])


def marked(system: str, ttl: str = "5m") -> list[dict]:
    return [{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": ttl}}]


def expected_text(reference_model, tokenizer, ids: list[int], max_tokens: int) -> str:
    return tokenizer.decode(reference_greedy(reference_model, ids, max_tokens), skip_special_tokens=True)


# ------------------------------------------------------------ the client


def test_the_client_gets_greedy_replies_sync_async_and_streamed(client, stack, model, tokenizer, reference_model):
    system, question = "You are a concise assistant.", [{"role": "user", "content": "Name three primary colors."}]
    expected = expected_text(reference_model, tokenizer, rendered(tokenizer, system, question), NEW_TOKENS)
    # (The 2026 client has no sampling parameters: temperature travels in the body as the API takes it.)
    args = {"model": model, "max_tokens": NEW_TOKENS, "system": system, "messages": question, "extra_body": GREEDY}

    reply = client.messages.create(**args)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == model
    assert reply.content[0].type == "text" and reply.content[0].text == expected
    assert reply.stop_reason in ("max_tokens", "end_turn") and reply.usage.output_tokens <= NEW_TOKENS
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(rendered(tokenizer, system, question))

    async def async_call():
        async with anthropic.AsyncAnthropic(base_url=base_url(stack), api_key="acme-key", max_retries=0) as aclient:
            return await aclient.messages.create(**args)

    assert asyncio.run(async_call()).content[0].text == expected

    with client.messages.stream(**args) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(deltas) == expected and final.content[0].text == expected
    assert final.stop_reason == reply.stop_reason and final.usage.output_tokens == reply.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: read from the cache


def test_raw_stream_events_come_in_anthropics_order(stack, model):
    body = {"model": model, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", f"{stack.base_url}/messages", json=body, headers={"x-api-key": "acme-key"}) as reply:
        assert reply.status_code == 200
        names = [line.removeprefix("event: ") for line in reply.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    assert set(names[2:-3]) <= {"content_block_delta"}


def test_a_stop_sequence_ends_the_reply_and_is_named(client, model, tokenizer, reference_model):
    question = [{"role": "user", "content": "List the days of the week."}]
    expected = expected_text(reference_model, tokenizer, rendered(tokenizer, None, question), 40)
    stop = "Wednes"  # the greedy reply lists them one per line
    assert expected.index(stop) > 0, expected
    reply = client.messages.create(
        model=model, max_tokens=40, messages=question, stop_sequences=[stop], extra_body=GREEDY
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == expected[: expected.index(stop)]


def test_count_tokens_counts_the_rendered_prompt(client, model, tokenizer):
    system, question = "Be brief.", [{"role": "user", "content": "What is an anvil?"}]
    counted = client.messages.count_tokens(model=model, system=system, messages=question)
    assert counted.input_tokens == len(rendered(tokenizer, system, question))


def test_errors_are_in_anthropics_shape_with_its_statuses(stack, client, model):
    url, ok = f"{stack.base_url}/messages", {"x-api-key": "acme-key"}
    user = [{"role": "user", "content": "Hi"}]
    cases = [
        ({"model": model, "max_tokens": 4, "messages": user}, {"x-api-key": "wrong"}, 401, "authentication_error"),
        ({"model": model, "messages": user}, ok, 400, "invalid_request_error"),  # no max_tokens
        ({"model": "nope", "max_tokens": 4, "messages": user}, ok, 404, "not_found_error"),
        ({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, ok, 400,
         "invalid_request_error"),
        ({"model": model, "max_tokens": 4, "messages": user, "tools": [{"name": "x"}]}, ok, 400,
         "invalid_request_error"),
        ({"model": model, "max_tokens": 10**6, "messages": user}, ok, 400, "invalid_request_error"),
    ]  # fmt: skip
    for body, headers, status, kind in cases:
        reply = httpx.post(url, json=body, headers=headers)
        assert reply.status_code == status, (body, reply.text)
        assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == kind, reply.text
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=model, max_tokens=4, messages=[])


# ------------------------------------------------------------ explicit caching


def flood(client, model, tokenizer, blocks: int) -> None:
    """Unmarked prompts of ``blocks`` blocks in all: pool pressure that evicts what no pin holds."""
    for _ in range(max(1, blocks * BLOCK // 900)):
        client.messages.create(model=model, max_tokens=1, messages=[
            {"role": "user", "content": system_prompt(900, tokenizer)}])  # fmt: skip


def marked_blocks(tokenizer, system: str) -> int:
    """The blocks a mark on ``system`` pins: its turn, end included, block-aligned."""
    return (
        len(tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=True)["input_ids"]) // BLOCK
    )


def asker(client, model, system: str, ttl: str):
    def ask(question: str):
        turn = [{"role": "user", "content": question}]
        return client.messages.create(model=model, max_tokens=1, system=marked(system, ttl), messages=turn).usage

    return ask


def test_a_5m_mark_is_created_then_read_and_created_again_after_its_ttl(client, stack, model, tokenizer):
    system = system_prompt(1200, tokenizer)
    blocks, ask = marked_blocks(tokenizer, system), asker(client, model, system, "5m")
    pins_before = pins(stack)[0]
    first = ask("Do you ship abroad?")
    assert first.cache_creation_input_tokens == blocks * BLOCK and first.cache_read_input_tokens == 0
    assert first.cache_creation.ephemeral_5m_input_tokens == blocks * BLOCK
    prompt = len(rendered(tokenizer, system, [{"role": "user", "content": "Do you ship abroad?"}]))
    assert first.input_tokens + first.cache_creation_input_tokens == prompt
    second = ask("What do anvils cost?")
    assert second.cache_read_input_tokens >= blocks * BLOCK and second.cache_creation_input_tokens == 0
    # Expired (TTL_5M_S after its last use), its blocks are evictable: pressure takes them.
    assert wait_for(lambda: pins(stack)[0] == pins_before, TTL_5M_S + 30), "the mark did not expire"
    flood(client, model, tokenizer, 300)
    again = ask("Do you repair magnets?")
    assert again.cache_creation_input_tokens == blocks * BLOCK and again.cache_read_input_tokens < blocks * BLOCK


def test_a_1h_mark_holds_its_prefix_under_pool_pressure(stack, model, tokenizer):
    globex = anthropic.Anthropic(base_url=base_url(stack), api_key="globex-key", max_retries=0, timeout=300)
    system = system_prompt(1200, tokenizer)
    blocks, ask = marked_blocks(tokenizer, system), asker(globex, model, system, "1h")
    first = ask("Do you ship abroad?")
    assert first.cache_creation.ephemeral_1h_input_tokens == blocks * BLOCK
    flood(globex, model, tokenizer, 300)  # more than the pool: everything unpinned is evicted
    held = ask("Are rockets insured?")
    assert held.cache_read_input_tokens >= blocks * BLOCK, "the marked prefix was evicted while its TTL lasted"
    assert held.cache_creation_input_tokens == 0


def test_marks_over_the_tenants_quota_are_served_and_reported(stack, model, tokenizer):
    system = system_prompt((QUOTA_BLOCKS + 20) * BLOCK, tokenizer)
    body = {"model": model, "max_tokens": 1, "system": marked(system), "messages": [{"role": "user", "content": "Hi"}]}
    reply = httpx.post(f"{stack.base_url}/messages", json=body, headers={"x-api-key": "acme-key"}, timeout=300)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvd-cache-unpinned-breakpoints"] == "1"
    usage = reply.json()["usage"]
    assert usage["cache_creation_input_tokens"] == 0 and usage["kvd"]["unpinned_breakpoints"] == 1


def test_two_tenants_marking_the_same_prefix_never_read_each_others_blocks(stack, model, tokenizer):
    system = system_prompt(300, tokenizer)  # globex also holds a 1h mark of 76 blocks
    body = {"model": model, "max_tokens": 1, "system": marked(system), "messages": [{"role": "user", "content": "Hi"}]}

    def usage(key: str) -> dict:
        reply = httpx.post(f"{stack.base_url}/messages", json=body, headers={"x-api-key": key}, timeout=300)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]

    acme = usage("acme-key")
    globex = usage("globex-key")
    assert acme["cache_creation_input_tokens"] > 0 and acme["cache_read_input_tokens"] == 0
    assert globex["cache_read_input_tokens"] == 0 and globex["cache_creation_input_tokens"] == acme[
        "cache_creation_input_tokens"]  # fmt: skip
    assert usage("globex-key")["cache_read_input_tokens"] >= acme["cache_creation_input_tokens"]


def test_the_diagnosis_names_where_a_system_prompts_timestamp_changed(client, stack, model, tokenizer):
    """Asked as the client asks (``diagnostics``): Anthropic's reason, and kvd's token-level detail beside it."""
    rules = system_prompt(300, tokenizer)
    turn = [{"role": "user", "content": "Hi"}]

    def system(stamp: str) -> str:
        return f"{rules}\nCurrent time: {stamp}.\n{FILLER * 3}"

    def ask(stamp: str, previous: str | None):
        return client.messages.create(
            model=model,
            max_tokens=1,
            system=system(stamp),
            messages=turn,
            diagnostics={"previous_message_id": previous},
        )

    first = ask("2026-11-29 10:15:02", None)
    assert first.diagnostics.cache_miss_reason is None  # nothing to compare with
    second = ask("2026-11-29 10:15:09", first.id)
    ids, earlier = (
        rendered(tokenizer, system("2026-11-29 10:15:09"), turn),
        rendered(tokenizer, system("2026-11-29 10:15:02"), turn),
    )
    at = next(i for i, (a, b) in enumerate(zip(ids, earlier, strict=False)) if a != b)
    reason = second.diagnostics.cache_miss_reason
    assert reason.type == "system_changed" and reason.cache_missed_input_tokens == len(earlier) - at
    detail = second.diagnostics.model_extra["kvd_cache_diagnosis"]
    assert detail["has_earlier"] and detail["common_tokens"] == at
    assert int(detail["token"]) == ids[at] and int(detail["earlier_token"]) == earlier[at]
    assert "10:15:0" in detail["text_before"] + detail["text_after"]
    assert detail["cached_tokens"] == at // BLOCK * BLOCK
    appended = client.messages.create(
        model=model, max_tokens=1, system=system("2026-11-29 10:15:09"), diagnostics={"previous_message_id": second.id},
        messages=[*turn, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    )  # fmt: skip
    assert appended.diagnostics.cache_miss_reason is None  # messages only appended: nothing missed
    other = anthropic.Anthropic(base_url=base_url(stack), api_key="globex-key", max_retries=0, timeout=300)
    foreign = other.messages.create(
        model=model, max_tokens=1, messages=turn, diagnostics={"previous_message_id": first.id}
    )
    assert foreign.diagnostics.cache_miss_reason.type == "previous_message_not_found"
    metrics = httpx.get(f"{stack.base_url.removesuffix('/v1')}/metrics").text
    assert 'kvd_gateway_prompt_diverged_at_tokens_count{tenant="acme"}' in metrics


def test_the_openai_api_and_grpc_take_the_same_marks_and_report_the_same_split(stack, model, tokenizer):
    """One implementation behind the three APIs: a text part's ``cache_control`` on
    /v1/chat/completions, a breakpoint on gRPC, ``--cache-ttl`` in kvd-cli."""
    system = system_prompt(400, tokenizer)
    blocks = marked_blocks(tokenizer, system)
    client = openai.OpenAI(base_url=stack.base_url, api_key="acme-key", max_retries=0, timeout=300)
    part = {"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    ask = lambda: client.chat.completions.create(  # noqa: E731
        model=model, max_tokens=1, messages=[{"role": "system", "content": [part]}, {"role": "user", "content": "Hi"}],
        extra_body={"kvd_diagnose_cache": True},
    )  # fmt: skip
    first, second = ask(), ask()
    details = first.usage.prompt_tokens_details.model_extra
    assert details["cache_creation_tokens"] == blocks * BLOCK == details["cache_creation"]["ephemeral_1h_input_tokens"]
    assert second.usage.prompt_tokens_details.cached_tokens >= blocks * BLOCK
    assert second.usage.prompt_tokens_details.model_extra["cache_creation_tokens"] == 0
    assert second.choices[0].model_extra["kvd_cache_diagnosis"]["has_earlier"]

    other = system_prompt(400, tokenizer)
    chat = [("system", other), ("user", "Hi")]
    mark = pb.CacheBreakpoint(message=0, ttl=pb.CACHE_TTL_5M)
    with GatewayClient(stack.gateway.address, api_key="acme-key", timeout_s=300) as grpc_client:
        usage = grpc_client.complete(chat=chat, cache_breakpoints=[mark], max_new_tokens=1).usage
        again = grpc_client.complete(chat=chat, cache_breakpoints=[mark], diagnose_cache=True, max_new_tokens=1)
    assert usage.cache_creation_tokens == usage.cache_creation_5m_tokens == marked_blocks(tokenizer, other) * BLOCK
    assert again.usage.cached_prompt_tokens >= usage.cache_creation_tokens and again.cache_diagnosis.has_earlier

    cli = [
        sys.executable,
        "-m",
        "gateway.client_cli",
        "--address",
        stack.gateway.address,
        "--api-key",
        "acme-key",
        "generate",
        system_prompt(400, tokenizer),
        "--max-new-tokens",
        "1",
        "--cache-ttl",
        "1h",
        "--diagnose-cache",
    ]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=300, check=True).stdout  # fmt: skip
    assert '"cacheCreation1hTokens"' in out and '"promptTokens"' in out, out


def test_a_1h_mark_outlives_an_engine_restart_and_with_disk_a_daemon_sigkill(model_dir, tokenizer):
    folder = tempfile.mkdtemp(prefix="kvd-msg1h-", dir="/tmp")
    # NOTE: the disk writer's backlog is half the host tier (kvd/disk_tier.py) and a block
    # offered while it is full is never written: 128 slots queue all of the mark's 33 blocks
    # however fast the engine's two prefill steps come (with 64 the second one's block was
    # skipped whenever it came before the writer had finished the first's 32).
    disk = ["--host-num-blocks", "128", "--disk-path", f"{folder}/disk", "--disk-budget", "1GiB"]
    daemon_args = ["--block-size", str(BLOCK), "--num-blocks", "256", "--lease-s", "2", *disk]
    with http_stack(model_dir, daemon_args, gateway_args=["--cache-ttl-5m-s", "1"], folder=folder) as s:
        client = anthropic.Anthropic(base_url=base_url(s), api_key="unused", max_retries=2, timeout=300)
        model = httpx.get(f"{s.base_url}/models").json()["data"][0]["id"]
        system = system_prompt(500, tokenizer)

        def ask():
            turn = [{"role": "user", "content": "Hi"}]
            return client.messages.create(model=model, max_tokens=1, system=marked(system, "1h"), messages=turn).usage

        created = ask().cache_creation.ephemeral_1h_input_tokens
        assert created >= 400
        time.sleep(2)  # past a 5m mark's shortened TTL: a 1h mark stays
        assert pins(s)[0] == 1
        s.engine.stop()
        s.engine.start()
        assert wait_for(lambda: httpx.get(f"{s.base_url.removesuffix('/v1')}/ready").status_code == 200, 60)
        assert ask().cache_read_input_tokens >= created
        assert wait_for(lambda: disk_blocks(s) >= created // BLOCK, 30)
        s.daemon.stop(signal.SIGKILL)
        s.daemon.start()
        assert wait_for(lambda: httpx.get(f"{s.base_url.removesuffix('/v1')}/ready").status_code == 200, 60)
        usage = ask()
        assert usage.cache_read_input_tokens >= created and usage.cache_creation_input_tokens == 0
        assert pins(s)[0] == 1  # marked again on the way: pinned in the new daemon


def disk_blocks(stack) -> int:
    with DaemonClient.connect(stack.daemon.address) as daemon:
        return daemon.stats().num_disk_blocks
