"""What deploy/test_compose.sh checks on a running compose stack, from this host.

Every request goes through the published gateway port only; the containers are
touched as an operator would: ``kill -s KILL`` on the engine's process, ``podman
restart`` on Redis, and ``podman exec`` for the daemon's ``Stats`` (its unix socket
is its container's user's only). The greedy references are computed here, outside
the containers, with transformers' ``model.generate`` on the same model.

    .venv/bin/python deploy/compose_checks.py --gateway 127.0.0.1:50061 --project kvdci

Not a pytest module (pytest collects tests/ only): it needs the stack the script starts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gateway.client import GatewayClient  # noqa: E402
from inference import model_store  # noqa: E402
from tests.integration.engine_client import reference_greedy  # noqa: E402
from tests.integration.gateway_client import completion, document  # noqa: E402

MAX_NEW_TOKENS = 8
#: The daemon's Stats, read inside its container over its unix socket.
STATS = (
    "import json; from kvd.common.client import DaemonClient; "
    "s = DaemonClient.connect('unix:/run/kvd/kvd.sock').stats(); "
    "print(json.dumps({f.name: getattr(s, f.name) for f in s.DESCRIPTOR.fields}))"
)


def log(message: str) -> None:
    print(f"[compose_checks] {message}", file=sys.stderr, flush=True)


def wait_for(what: str, check: Callable[[], object], timeout_s: float = 120.0):
    """Polls ``check`` until it returns something truthy; fails naming ``what``."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - a service still starting; reported at the deadline
            last = exc
        time.sleep(1)
    raise AssertionError(f"{what}: not after {timeout_s:.0f}s (last: {last!r})")


class Stack:
    """The compose project's containers, found by the labels docker-compose sets."""

    def __init__(self, project: str) -> None:
        self.project = project

    def podman(self, *args: str) -> str:
        return subprocess.run(["podman", *args], check=True, capture_output=True, text=True, timeout=60).stdout

    def container(self, service: str) -> str:
        ids = self.podman(
            "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
            "--filter", f"label=com.docker.compose.service={service}",
        ).split()  # fmt: skip
        assert len(ids) == 1, f"{service}: {len(ids)} running containers"
        return ids[0]

    def state(self, service: str) -> dict:
        return json.loads(self.podman("inspect", self.container(service)))[0]

    def healthy(self, service: str) -> bool:
        state = self.state(service)["State"]
        return state["Status"] == "running" and state["Health"]["Status"] == "healthy"

    def daemon_stats(self) -> dict:
        return json.loads(self.podman("exec", self.container("kvd"), "python", "-c", STATS))


def readme_first_request(gateway: str) -> int:
    """Runs the README's command-line example as written; the cached prompt tokens it printed."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## A first request") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    env = {**os.environ, "KVD_GATEWAY_ADDR": gateway}
    output = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert output.returncode == 0, f"the README's example failed:\n{block}\n{output.stdout}\n{output.stderr}"
    usage = json.loads(output.stdout[output.stdout.rindex("{\n") :])
    log(f"README example: {output.stdout.strip()[:400]!r}")
    return int(usage.get("cachedPromptTokens", 0))


class Checks:
    def __init__(self, gateway: str, project: str) -> None:
        self.gateway = gateway
        self.stack = Stack(project)
        self.client = GatewayClient(gateway, timeout_s=300)
        model_dir = model_store.resolve_model("smollm2", model_store.default_cache_dir())
        self.tokenizer = model_store.load_tokenizer(model_dir)
        self.model = model_store.load_model(model_dir, torch.float64)
        self.block_size = 0

    def serving(self) -> bool:
        info = self.client.info()
        self.block_size = info.block_size
        return bool(info.replicas) and all(r.serving for r in info.replicas)

    def template_blocks(self, name: str) -> int:
        """The template's tokens in whole blocks: what a request after it must find cached."""
        template = self.client.get_template(name)
        assert template.cached_token_count > 0, template
        return template.token_count // self.block_size * self.block_size

    def greedy_prompts(self, salt: str) -> list[list[int]]:
        texts = [document(self.tokenizer, 40) + f" Question {salt}{i}: who met?" for i in range(3)]
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def check_greedy(self, salt: str) -> None:
        for ids in self.greedy_prompts(salt):
            tokens, _ = completion(self.client, ids, max_new_tokens=MAX_NEW_TOKENS)
            expected = reference_greedy(self.model, ids, MAX_NEW_TOKENS)
            assert tokens == expected, f"greedy output {tokens} != model.generate {expected}"
        log(f"greedy ({salt}): 3 prompts equal model.generate, {MAX_NEW_TOKENS} tokens each")

    def check_template_warm(self, name: str, question: str) -> int:
        _, usage = completion(self.client, question, template=name, max_new_tokens=4)
        warm = self.template_blocks(name)
        assert usage.cached_prompt_tokens >= warm > 0, (usage, warm)
        return usage.cached_prompt_tokens

    def first_request(self) -> None:
        cached = readme_first_request(self.gateway)
        warm = self.template_blocks("support-bot")
        assert cached >= warm >= 16, f"the README example's usage shows {cached} cached tokens, template {warm}"
        log(f"README first request: cachedPromptTokens={cached} (the template's {warm} block-aligned tokens)")

    def engine_killed(self) -> None:
        before = self.stack.daemon_stats()
        engine = self.stack.state("inference")
        daemon_restarts = self.stack.state("kvd")["RestartCount"]
        pid = engine["State"]["Pid"]
        subprocess.run(["kill", "-s", "KILL", str(pid)], check=True)
        log(f"engine container {engine['Name']}: kill -s KILL {pid}")
        wait_for(
            "the engine container restarted",
            lambda: (
                self.stack.state("inference")["RestartCount"] > engine["RestartCount"]
                and self.stack.state("inference")["State"]["Pid"] not in (0, pid)
            ),
            timeout_s=60,
        )
        wait_for("the restarted engine healthy", lambda: self.stack.healthy("inference"), timeout_s=240)
        wait_for("the gateway serving again", self.serving, timeout_s=120)
        self.check_greedy("after-kill-")
        cached = self.check_template_warm("support-bot", " Customer: do you ship rockets? Assistant:")

        def released() -> dict | None:
            stats = self.stack.daemon_stats()
            idle = stats["num_sessions"] == 1 and stats["num_requests"] == 0
            held = stats["num_used_blocks"] - stats["num_pinned_blocks"]
            clean = stats["num_quarantined_sessions"] == 0 and stats["num_quarantined_blocks"] == 0
            return stats if idle and clean and held == 0 else None

        after = wait_for("no block held by the dead session", released, timeout_s=90)
        assert self.stack.state("kvd")["RestartCount"] == daemon_restarts, "the daemon restarted too"
        assert after["num_pins"] == before["num_pins"] and after["num_pinned_blocks"] == before["num_pinned_blocks"]
        log(
            f"after the kill: template warm ({cached} cached tokens), daemon Stats: 1 session, "
            f"{after['num_used_blocks']} used blocks = {after['num_pinned_blocks']} pinned, "
            f"{after['num_pins']} pins as before, no quarantine"
        )

    def redis_restarted(self) -> None:
        self.client.create_template("after-aof", "Minutes of the harbour board. " + document(self.tokenizer, 40))
        names = {t.name for t in self.client.list_templates()}
        time.sleep(2)  # appendfsync everysec: on disk within a second
        redis = self.stack.container("redis")
        self.stack.podman("restart", redis)
        wait_for("Redis healthy after its restart", lambda: self.stack.healthy("redis"), timeout_s=60)
        keys = self.stack.podman("exec", redis, "redis-cli", "--scan").split()
        for name in names:
            assert any(name in key for key in keys), f"template {name} lost with the Redis restart: {keys}"
        assert {t.name for t in wait_for("templates listed", lambda: list(self.client.list_templates()))} >= names
        self.check_template_warm("after-aof", " Who chaired?")
        log(f"Redis restarted: templates {sorted(names)} still there (AOF), a templated request served")

    def run(self) -> None:
        wait_for("the gateway serving", self.serving, timeout_s=240)
        self.first_request()
        self.check_greedy("")
        self.engine_killed()
        self.redis_restarted()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", required=True, help="HOST:PORT the stack publishes")
    parser.add_argument("--project", required=True, help="the compose project name")
    args = parser.parse_args()
    Checks(args.gateway, args.project).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
