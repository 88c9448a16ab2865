"""Every Python example of the README and of docs/ runs as written.

Each ```python block is executed against real processes started for it; the
only change is the address it names, pointed at the test's own. The README's is
the gateway's first request; docs/daemon.md's speaks the daemon's Step;
docs/structured-outputs.md's parses a reply into a pydantic model; docs/caching.md's
marks a system prompt through the Messages API with the ``anthropic`` client.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import pytest
import redis

from tests.conftest import free_port, start_daemon, start_engine, start_gateway

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DAEMON_ADDRESS = "unix:/tmp/kvd-0/kvd.sock"
GATEWAY_ADDRESS = "127.0.0.1:50051"
HTTP_ADDRESS = "http://127.0.0.1:8000/v1"
ANTHROPIC_ADDRESS = 'base_url="http://127.0.0.1:8000"'


def python_blocks() -> list[str]:
    return [b for page in PAGES for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)]


def test_every_python_block_is_covered():
    blocks = python_blocks()
    assert len(blocks) == 5 and sum(ANTHROPIC_ADDRESS in b for b in blocks) == 1
    assert sum(DAEMON_ADDRESS in b for b in blocks) == 1 and sum(GATEWAY_ADDRESS in b for b in blocks) == 1
    assert sum(HTTP_ADDRESS in b for b in blocks) == 2
    assert GATEWAY_ADDRESS in re.findall(r"```python\n(.*?)```", PAGES[0].read_text(), flags=re.DOTALL)[0]


def test_the_daemon_example_runs_as_written(workdir):
    (block,) = [b for b in python_blocks() if DAEMON_ADDRESS in b]
    daemon = start_daemon(["--block-size", "16", "--num-blocks", "32"], workdir)
    try:
        exec(compile(block.replace(DAEMON_ADDRESS, daemon.address), "docs/daemon.md", "exec"), {})
        with daemon.client() as client:
            stats = client.stats()
        assert stats.num_used_blocks == 0 and stats.num_sessions == 0 and stats.query_tokens == 60
    finally:
        daemon.stop()


@pytest.fixture
def redis_prefix():
    prefix = f"kvd-test-{secrets.token_hex(4)}:"
    yield prefix
    server = redis.Redis(host="127.0.0.1", port=6379)
    for key in server.scan_iter(f"{prefix}*"):
        server.delete(key)


def test_the_gateway_example_runs_as_written(workdir, model_dir, redis_prefix, capsys):
    (block,) = [b for b in python_blocks() if GATEWAY_ADDRESS in b]
    http_block, structured_block = [b for b in python_blocks() if HTTP_ADDRESS in b]
    daemon = start_daemon(["--block-size", "16", "--num-blocks", "256"], workdir)
    engine = start_engine(daemon, ["--model", str(model_dir)], workdir)
    http = f"127.0.0.1:{free_port()}"
    gateway = start_gateway(
        engine.address,
        ["--redis-url", "redis://127.0.0.1:6379/0", "--redis-prefix", redis_prefix, "--http-listen", http],
        workdir,
    )
    try:
        exec(compile(block.replace(GATEWAY_ADDRESS, gateway.address), "README.md", "exec"), {})
        printed = capsys.readouterr().out.split()
        assert len(printed) >= 2 and int(printed[-1]) >= 0  # some text, then the cached prompt tokens
        # The HTTP example, after it: the template it created is cached.
        exec(compile(http_block.replace(HTTP_ADDRESS, f"http://{http}/v1"), "README.md", "exec"), {})
        printed = capsys.readouterr().out.split()
        assert len(printed) >= 2 and int(printed[-1]) >= 16  # some text, then the blocks the gRPC example computed
        page = "docs/structured-outputs.md"
        exec(compile(structured_block.replace(HTTP_ADDRESS, f"http://{http}/v1"), page, "exec"), {})
        assert re.fullmatch(r"name='.*' country='.*' population=-?\d+", capsys.readouterr().out.strip())
        (messages_block,) = [b for b in python_blocks() if ANTHROPIC_ADDRESS in b]
        messages_block = messages_block.replace(ANTHROPIC_ADDRESS, f'base_url="http://{http}"')
        exec(compile(messages_block, "docs/caching.md", "exec"), {})
        (created, read_1), (created_2, read) = [map(int, line.split()) for line in capsys.readouterr().out.splitlines()]
        assert created >= 16 * 20 and created_2 == 0 and read >= created  # the marked blocks, then read
    finally:
        gateway.stop()
        engine.stop()
        daemon.stop()
