"""Tenant isolation end to end, in both tiers, and a request's own cache salt;
and no API key or prompt/template content in the logs at the default level.

One daemon with a small device pool and a host tier, a float32 engine, a
gateway with keys for two tenants.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.client import GatewayClient
from kvd.common.client import DaemonClient
from tests.conftest import start_gateway, wait_for
from tests.integration.gateway_client import completion

KEYS = {"tenant-a-secret-key": "alpha", "tenant-b-secret-key": "beta"}
SECRET_DOC = (
    "Confidential memo of the alpha company: the harbour contract is signed for nine hundred crowns, and the "
    "northern lock will close for repairs in the second week of spring, after the floods. "
) * 3


@pytest.fixture
def gateway(stack_factory, workdir):
    engine = stack_factory(daemon_args=["--num-blocks", "48", "--host-num-blocks", "512"])
    keys = [{"key": k, "tenant": t, "scopes": ["generate", "templates:write"]} for k, t in KEYS.items()]
    Path(workdir, "keys.json").write_text(json.dumps({"keys": keys}))
    gw = start_gateway(engine.address, ["--data-dir", f"{workdir}/gw", "--api-keys", f"{workdir}/keys.json"], workdir)
    yield gw, engine
    gw.stop()


def _flood_device_tier(client: GatewayClient, n: int) -> None:
    """Distinct prompts that push everything else out of the 48-block device pool."""
    for i in range(n):
        words = " ".join(f"w{i}x{j}" for j in range(120))
        completion(client, words, max_new_tokens=1)


def test_tenants_and_salts_never_share_cached_blocks_in_either_tier(gateway):
    gw, engine = gateway
    with (
        GatewayClient(gw.address, api_key="tenant-a-secret-key", timeout_s=120) as alpha,
        GatewayClient(gw.address, api_key="tenant-b-secret-key", timeout_s=120) as beta,
    ):
        alpha_tokens, first = completion(alpha, SECRET_DOC)
        assert first.cached_prompt_tokens == 0
        # Device tier: the same prompt from another tenant, or with a salt of its own, hits nothing.
        assert completion(beta, SECRET_DOC)[1].cached_prompt_tokens == 0
        assert completion(alpha, SECRET_DOC, cache_salt=b"mine")[1].cached_prompt_tokens == 0
        assert completion(alpha, SECRET_DOC)[1].cached_prompt_tokens > 0

        # Host tier: a second memo, sent by alpha only, then pushed out of the
        # device pool: only the host tier has its blocks.
        memo = SECRET_DOC.replace("alpha company", "alpha holding")
        memo_tokens, _ = completion(alpha, memo)
        with DaemonClient.connect(engine.daemon.address) as daemon:
            assert wait_for(lambda: daemon.stats().num_host_cached_blocks > 0, 30)
            _flood_device_tier(alpha, 6)
            host_hits = daemon.stats().host_hit_tokens
            assert completion(beta, memo)[1].cached_prompt_tokens == 0
            assert completion(alpha, memo, cache_salt=b"mine2")[1].cached_prompt_tokens == 0
            assert daemon.stats().host_hit_tokens == host_hits  # neither read alpha's host copies
            tokens, usage = completion(alpha, memo)
            assert usage.cached_prompt_tokens > 0 and daemon.stats().host_hit_tokens > host_hits
            assert tokens == memo_tokens
        assert alpha_tokens

    # Neither the keys nor the prompt's content reach the logs at the default level.
    for log in (gw.log(), engine.log(), engine.daemon.log()):
        for secret in (*KEYS, "Confidential memo", "nine hundred crowns"):
            assert secret not in log
