"""Explicit caching through Anthropic's Messages API under pool pressure: the
time to first token of marked agent turns with their marks honoured against
the same workload with its marks refused, and what keeping them pinned costs.

    .venv/bin/python benchmarks/messages.py --json benchmarks/results/messages.json [--quick]

Two stacks side by side, each a daemon (a small device pool: 2.5 system
prompts' blocks, no host or disk tier, so an evicted prefix is computed
again), a float32 SmolLM2 engine and a gateway with its embedded Redis,
called on ``/v1/messages`` with the ``anthropic`` client:

- ``marks_honoured``: the gateway's default (no per-tenant pin quota): the
  daemon pins each marked prefix for its TTL (``5m``), refreshed by every
  request that marks it again (under its pin cap, ``--max-pinned-fraction``).
- ``marks_ignored``: the same, with ``--max-pinned-blocks 1``: every mark is
  over the tenant's quota, refused and counted in
  ``usage.kvd.unpinned_breakpoints``, so a marked prefix is evicted by the
  pressure exactly as an unmarked one.

The workload, the same in both (same seed, same prompts): ``--agents``
conversations share one ~2,000-token system prompt (``cache_control`` on the
system block) and take ``--turns`` turns each, one marked request at a time,
agent after agent; each turn's user message (``cache_control`` on its text
block: the latest turn is marked, as Anthropic advises) gets a greedy reply
of ``--reply-tokens`` tokens that stays in the conversation. Meanwhile
``--pressure-clients`` clients send distinct, unmarked, long prompts back to
back (one output token each). Before each marked request but a stack's
first, the agent waits until the pressure has evicted ``--pool-cycles``
times the pool's blocks since the previous marked request ended (so even
the shared system prompt is evicted unless pinned; between one agent's
turns the pool turns over about ``--agents`` times). Only the marked
requests' time to first token is measured: new pressure waits while a
marked reply streams (the requests in flight go on). The turns are split
into ``--rounds`` rounds, the two stacks taking turns round by round (the
order alternating), so the machine's drift falls on both alike.

Measured per stack: the marked requests' time to first token (the first text
delta of the stream, by the client's clock; the first request is cold on
both), their cache reads and cache creation (sums of Anthropic's usage),
the unmarked requests' time to first token (a one-token reply's time), and
``pinned_block_seconds``: the integral of the daemon's ``num_pinned_blocks``
(sampled every ``--sample-s``) over the stack's own rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
from harness.text import english_like, exact_tokens

CONFIGS = ("marks_honoured", "marks_ignored")
#: The gateway's per-tenant pin quota of each stack: 0 is none (only the
#: daemon's pin cap), 1 block refuses every mark (each is longer than a block).
QUOTA = {"marks_honoured": 0, "marks_ignored": 1}
BLOCK_SIZE = 16
GREEDY = {"temperature": 0.0}
MARK = {"type": "ephemeral", "ttl": "5m"}
TOPICS = ("a delayed shipment", "a refund", "a broken part", "an invoice", "a password reset", "a new order",
          "a change of address", "a warranty claim")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, quick_help="a small workload (under two minutes)")
    p.add_argument("--agents", type=int, default=2, help="agent conversations sharing the system prompt")
    p.add_argument("--turns", type=int, help="marked turns per agent (default 3; quick 2)")
    p.add_argument("--rounds", type=int, help="rounds the turns are split into (default: a turn each; quick 1)")
    p.add_argument("--system-tokens", type=int, help="the agents' marked system prompt (default 2000; quick 1000)")
    p.add_argument("--turn-tokens", type=int, default=64, help="each turn's user message")
    p.add_argument("--reply-tokens", type=int, default=8, help="each agent reply's max_tokens (greedy)")
    p.add_argument("--pressure-clients", type=int, default=2, help="clients sending unmarked prompts back to back")
    p.add_argument("--pressure-tokens", type=int, help="each unmarked prompt's length (default 768; quick 384)")
    p.add_argument("--pool-cycles", type=float, default=1.0, help="pools' blocks evicted between marked requests")
    p.add_argument("--num-blocks", type=int, help="the daemon's pool (default: 2.5 system prompts' blocks)")
    p.add_argument("--max-pinned-fraction", type=float, default=0.75, help="the daemon's pin cap")
    p.add_argument("--sample-s", type=float, default=0.2, help="how often the daemon's pins are sampled")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--workdir", help="run here and keep the processes' logs (default: a temporary folder)")
    args = p.parse_args(argv)
    args.turns = args.turns or (2 if args.quick else 3)
    args.rounds = min(args.rounds or (1 if args.quick else args.turns), args.turns)
    args.system_tokens = args.system_tokens or (1000 if args.quick else 2000)
    args.pressure_tokens = args.pressure_tokens or (384 if args.quick else 768)
    args.num_blocks = args.num_blocks or -(-5 * args.system_tokens // (2 * BLOCK_SIZE))
    return args


# ------------------------------------------------------------ the workload


@dataclass(frozen=True)
class Workload:
    """The texts both stacks get: the system prompt, each agent's user turns,
    and the pressure prompts (made on demand, each from its own seed)."""

    system: str
    turns: list[list[str]]  # [agent][turn]
    seed: int
    pressure_tokens: int
    tokenizer: Any

    @classmethod
    def make(cls, args: argparse.Namespace, tokenizer) -> Workload:
        rng = random.Random(args.seed)
        lead = "You are the support agent of a hardware shop. Follow the policies below exactly.\n\n"
        system = tokenizer.decode(exact_tokens(tokenizer, lead, args.system_tokens, rng))
        turns = [
            [
                tokenizer.decode(
                    exact_tokens(
                        tokenizer,
                        f"Customer {a}, step {t + 1}: a question about {rng.choice(TOPICS)}. ",
                        args.turn_tokens,
                        rng,
                    )
                )
                for t in range(args.turns)
            ]
            for a in range(args.agents)
        ]
        return cls(system, turns, args.seed, args.pressure_tokens, tokenizer)

    def pressure(self, round_: int, client: int, i: int) -> str:
        """Unmarked prompt ``i`` of pressure client ``client`` in round ``round_``,
        the same in both stacks: its own from its nonce on (only the chat
        template's default system prompt before it is shared)."""
        rng = random.Random(f"{self.seed}-{round_}-{client}-{i}")
        lead = f"Report {round_}.{client}.{i}. "
        return self.tokenizer.decode(exact_tokens(self.tokenizer, lead + english_like(rng, 4), self.pressure_tokens,
                                                  rng))  # fmt: skip


# ------------------------------------------------------------ a stack


@dataclass
class Marked:
    """One marked (agent) request as its client saw it, with its usage."""

    agent: int
    turn: int
    ttft_s: float
    server_ttft_s: float
    input_tokens: int
    cache_read_tokens: int
    cache_creation_tokens: int
    unpinned_breakpoints: int


@dataclass
class Unmarked:
    sent_s: float
    reply_s: float  # a one-token reply: its time to first token
    prompt_tokens: int
    cache_read_tokens: int
    error: str | None = None


@dataclass
class Sample:
    at_s: float
    pinned_blocks: int
    pins: int
    evictions: int


class Stack:
    """A daemon, an engine and a gateway serving ``/v1/messages``, and what was measured on it."""

    def __init__(self, config: str, workdir: Path, model_dir: Path, args: argparse.Namespace) -> None:
        self.config = config
        daemon = ["--block-size", str(BLOCK_SIZE), "--num-blocks", str(args.num_blocks), "--metrics-port", "0",
                  "--max-pinned-fraction", str(args.max_pinned_fraction), "--log-level", "warning"]  # fmt: skip
        self.daemon = harness.DaemonProcess(workdir, daemon, name=f"kvd-{config}")
        self.engine = harness.EngineProcess(
            workdir, self.daemon.address, ["--model", str(model_dir), "--log-level", "warning"], name=f"engine-{config}"
        )
        gateway = ["--max-pinned-blocks", str(QUOTA[config]), "--log-level", "warning"]
        self.gateway = harness.GatewayProcess(
            workdir, self.engine.address, gateway, http=True, name=f"gateway-{config}", data_dir=f"gateway-{config}"
        )
        self.marked: list[Marked] = []
        self.unmarked: list[Unmarked] = []
        self.samples: list[list[Sample]] = []  # per round measured
        self.measured_s = 0.0
        self.client = None
        self.model = ""
        self.histories: list[list[dict]] = []

    def start(self, agents: int) -> Stack:
        """Starts its processes (stopped by ``stop``, however far this got) and its client."""
        import anthropic
        import httpx2 as httpx

        for handle in (self.daemon, self.engine, self.gateway):
            handle.start()
        base = f"http://{self.gateway.http_address}"
        if not harness.wait_for(lambda: _ready(httpx, base), 60, 0.1):
            raise RuntimeError(f"{self.config}: the gateway's HTTP API is not ready: {self.gateway.log_tail()}")
        self.model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        self.client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=600)
        self.histories = [[] for _ in range(agents)]
        # Warm-up (not measured): the gateway's tokenizer and the engine's paths.
        self.client.messages.create(model=self.model, max_tokens=2, extra_body=GREEDY,
                                    messages=[{"role": "user", "content": "Hello."}])  # fmt: skip
        return self

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        for handle in (self.gateway, self.engine, self.daemon):
            handle.stop()

    def stats(self, daemon) -> Sample:
        s = daemon.stats()
        return Sample(time.perf_counter(), s.num_pinned_blocks, s.num_pins, s.evictions)

    def ask(self, system: str, agent: int, turn: int, text: str, reply_tokens: int, first_token=None) -> Marked:
        """The agent's next turn: the system block and the new user message marked,
        streamed; ``first_token`` is called when its first text arrives."""
        history = self.histories[agent]
        messages = [*history, {"role": "user", "content": [{"type": "text", "text": text, "cache_control": MARK}]}]
        start, ttft, usage = time.perf_counter(), None, None
        with self.client.messages.stream(
            model=self.model, max_tokens=reply_tokens, messages=messages, extra_body=GREEDY,
            system=[{"type": "text", "text": system, "cache_control": MARK}],
        ) as stream:  # fmt: skip
            for event in stream:
                if ttft is None and event.type == "content_block_delta":
                    ttft = time.perf_counter() - start
                    if first_token is not None:
                        first_token()
                if event.type == "message_delta":
                    usage = event.usage.to_dict()
            reply = "".join(block.text for block in stream.get_final_message().content if block.type == "text")
        assert usage is not None, "the stream ended without usage"
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        kvd = usage.get("kvd", {})
        return Marked(agent, turn, ttft if ttft is not None else time.perf_counter() - start,
                      kvd.get("time_to_first_token_s", 0.0), usage.get("input_tokens") or 0,
                      usage.get("cache_read_input_tokens") or 0, usage.get("cache_creation_input_tokens") or 0,
                      kvd.get("unpinned_breakpoints", 0))  # fmt: skip


def _ready(httpx, base: str) -> bool:
    try:
        return httpx.get(f"{base}/ready").status_code == 200
    except httpx.HTTPError:
        return False


class Pressure:
    """Clients sending distinct unmarked prompts back to back until stopped;
    ``hold`` keeps them from sending more (the ones in flight go on) until ``go``."""

    def __init__(self, stack: Stack, workload: Workload, round_: int, clients: int) -> None:
        self.stack, self.workload, self.round = stack, workload, round_
        self._stop = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self._threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(clients)]

    def __enter__(self) -> Pressure:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._go.set()
        for thread in self._threads:
            thread.join(600)

    def hold(self) -> None:
        self._go.clear()

    def go(self) -> None:
        self._go.set()

    def _client(self, n: int) -> None:
        import anthropic

        stack, i = self.stack, 0
        while self._go.wait() and not self._stop.is_set():
            document = self.workload.pressure(self.round, n, i)
            i += 1
            sent = time.perf_counter()
            try:
                reply = stack.client.messages.create(
                    model=stack.model, max_tokens=1, extra_body=GREEDY,
                    messages=[{"role": "user", "content": document + "\n\nSummarize the report in one line."}],
                )  # fmt: skip
            except anthropic.APIError as err:
                stack.unmarked.append(Unmarked(sent, 0.0, 0, 0, f"{type(err).__name__}: {err}"))
                time.sleep(0.1)
                continue
            u = reply.usage
            prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
            stack.unmarked.append(Unmarked(sent, time.perf_counter() - sent, prompt, u.cache_read_input_tokens or 0))


class Sampler:
    """Samples the daemon's pins and evictions every ``interval_s`` while a round runs."""

    def __init__(self, stack: Stack, interval_s: float) -> None:
        self.stack, self.interval_s = stack, interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._daemon = stack.daemon.client()

    def __enter__(self) -> Sampler:
        self.samples.append(self.stack.stats(self._daemon))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        self.samples.append(self.stack.stats(self._daemon))
        self._daemon.close()
        self.stack.samples.append(self.samples)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.stack.stats(self._daemon))

    @property
    def evictions(self) -> int:
        return self.samples[-1].evictions


def run_round(stack: Stack, workload: Workload, args: argparse.Namespace, round_: int, progress) -> None:
    """One round on one stack: its turns of every agent, one marked request at a
    time, each after the pressure has evicted ``pool_cycles`` pools' blocks (but
    the stack's first: its pool holds nothing yet)."""
    first, last = round_ * args.turns // args.rounds, (round_ + 1) * args.turns // args.rounds
    target = args.pool_cycles * args.num_blocks
    start = time.perf_counter()
    with (
        Sampler(stack, args.sample_s) as sampler,
        Pressure(stack, workload, round_, args.pressure_clients) as pressure,
    ):
        for turn in range(first, last):
            for agent in range(args.agents):
                base = sampler.evictions
                if stack.marked and not harness.wait_for(lambda b=base: sampler.evictions - b >= target, 300, 0.05):
                    raise RuntimeError(f"{stack.config}: the pressure evicted {sampler.evictions - base} blocks "
                                       f"in 300 s, not {target:.0f}: {stack.daemon.log_tail()}")  # fmt: skip
                # NOTE: only its time to first token is measured: new pressure waits while its reply streams.
                try:
                    stack.marked.append(stack.ask(workload.system, agent, turn, workload.turns[agent][turn],
                                                  args.reply_tokens, pressure.hold))  # fmt: skip
                finally:
                    pressure.go()
                progress.advance()
    stack.measured_s += time.perf_counter() - start


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from inference import model_store

    model_dir = model_store.resolve_model(args.model, model_store.default_cache_dir())
    tokenizer = model_store.load_tokenizer(model_dir)
    workload = Workload.make(args, tokenizer)
    began = time.perf_counter()
    stacks = {config: Stack(config, workdir, model_dir, args) for config in CONFIGS}
    with contextlib.ExitStack() as exits:
        for stack in stacks.values():
            exits.callback(stack.stop)
        with ThreadPoolExecutor(len(stacks)) as pool:  # both stacks start at once
            list(pool.map(lambda s: s.start(args.agents), stacks.values()))
        startup_s = time.perf_counter() - began
        progress = harness.Progress("messages: marked requests", len(CONFIGS) * args.agents * args.turns)
        for r in range(args.rounds):
            for config in harness.turn_order(CONFIGS, r):
                run_round(stacks[config], workload, args, r, progress)
        progress.done()
    results = {config: summarize(stack, args) for config, stack in stacks.items()}
    replies = [h["content"] for s in stacks.values() for h in s.histories[0] if h["role"] == "assistant"]
    half = len(replies) // 2
    system_ids = tokenizer.apply_chat_template([{"role": "system", "content": workload.system}], tokenize=True)[
        "input_ids"
    ]
    workload_out = {
        "model": model_dir.name,
        "dtype": "float32",
        "api": "POST /v1/messages (anthropic client, streamed), cache_control ephemeral 5m",
        "agents": args.agents,
        "turns_per_agent": args.turns,
        "marked_requests": args.agents * args.turns,
        "rounds": args.rounds,
        "system_tokens": args.system_tokens,
        "system_marked_blocks": len(system_ids) // BLOCK_SIZE,
        "turn_tokens": args.turn_tokens,
        "reply_tokens": args.reply_tokens,
        "marks": "cache_control on the system block and on the latest user message's text block",
        "pressure_clients": args.pressure_clients,
        "pressure_prompt_tokens": args.pressure_tokens,
        "pool_cycles_between_marked": args.pool_cycles,
        "num_blocks": args.num_blocks,
        "block_size": BLOCK_SIZE,
        "pool_system_prompts": round(args.num_blocks * BLOCK_SIZE / args.system_tokens, 2),
        "max_pinned_fraction": args.max_pinned_fraction,
        "tiers": "device only (no host or disk tier): an evicted prefix is computed again",
        "marks_ignored": "the gateway's --max-pinned-blocks 1: every mark over the tenant's quota, refused",
        "pin_sample_s": args.sample_s,
        "agent_replies_equal": replies[:half] == replies[half:],
        "seed": args.seed,
        "startup_s": startup_s,
        "wall_s": time.perf_counter() - began,
    }
    return {"workload": workload_out, "results": results}


def pinned_block_seconds(rounds: list[list[Sample]]) -> float:
    """The integral of the pinned blocks over the stack's rounds (trapezoids between samples)."""
    return sum(
        (b.at_s - a.at_s) * (a.pinned_blocks + b.pinned_blocks) / 2
        for samples in rounds
        for a, b in zip(samples, samples[1:], strict=False)
    )


def summarize(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    marked, unmarked = stack.marked, [u for u in stack.unmarked if u.error is None]
    ttfts = [m.ttft_s for m in marked]
    later = [m.ttft_s for m in marked if m.turn > 0 or m.agent > 0]
    samples = [s for rounds in stack.samples for s in rounds]
    evictions = sum(r[-1].evictions - r[0].evictions for r in stack.samples)
    pinned_s = pinned_block_seconds(stack.samples)
    prompt_tokens = sum(m.input_tokens + m.cache_read_tokens + m.cache_creation_tokens for m in marked)
    return {
        "marked_requests": len(marked),
        "ttft_marked_mean_s": harness.mean(ttfts),
        "ttft_marked_p50_s": harness.median(ttfts),
        "ttft_marked_p90_s": harness.percentile(ttfts, 90),
        "ttft_marked_first_s": marked[0].ttft_s if marked else None,
        "ttft_marked_later_mean_s": harness.mean(later),
        "server_ttft_marked_mean_s": harness.mean([m.server_ttft_s for m in marked]),
        "marked_prompt_tokens": prompt_tokens,
        "cache_read_tokens": sum(m.cache_read_tokens for m in marked),
        "cache_creation_tokens": sum(m.cache_creation_tokens for m in marked),
        "input_tokens": sum(m.input_tokens for m in marked),
        "cache_read_share": sum(m.cache_read_tokens for m in marked) / prompt_tokens if prompt_tokens else None,
        "unpinned_breakpoints": sum(m.unpinned_breakpoints for m in marked),
        "pinned_block_seconds": pinned_s,
        "pinned_blocks_mean": pinned_s / stack.measured_s if stack.measured_s else None,
        "pinned_blocks_max": max((s.pinned_blocks for s in samples), default=0),
        "pins_max": max((s.pins for s in samples), default=0),
        "measured_s": stack.measured_s,
        "evictions": evictions,
        "pool_cycles": evictions / args.num_blocks,
        "pool_cycles_per_marked": evictions / args.num_blocks / len(marked) if marked else None,
        "pool_cycles_between_turns": evictions / args.num_blocks / args.turns if marked else None,
        "unmarked_requests": len(unmarked),
        "unmarked_errors": len(stack.unmarked) - len(unmarked),
        "pressure_tokens": sum(u.prompt_tokens for u in unmarked),
        "ttft_unmarked_mean_s": harness.mean([u.reply_s for u in unmarked]),
        "ttft_unmarked_p90_s": harness.percentile([u.reply_s for u in unmarked], 90),
        "unmarked_cache_read_tokens": sum(u.cache_read_tokens for u in unmarked),
    }


def report(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    results = out["results"]
    honoured, ignored = results["marks_honoured"], results["marks_ignored"]
    ratios = {
        "marked_ttft_honoured_over_ignored": harness.ratio(
            honoured["ttft_marked_mean_s"], ignored["ttft_marked_mean_s"]
        ),
        "marked_later_ttft_honoured_over_ignored": harness.ratio(
            honoured["ttft_marked_later_mean_s"], ignored["ttft_marked_later_mean_s"]
        ),
        "marked_ttft_p90_honoured_over_ignored": harness.ratio(
            honoured["ttft_marked_p90_s"], ignored["ttft_marked_p90_s"]
        ),
        "unmarked_ttft_honoured_over_ignored": harness.ratio(
            honoured["ttft_unmarked_mean_s"], ignored["ttft_unmarked_mean_s"]
        ),
        "honoured_cache_read_share": honoured["cache_read_share"],
        "ignored_cache_read_share": ignored["cache_read_share"],
    }
    return harness.stack_report("messages", args.quick, out["workload"], harness.rounded(results),
                                harness.rounded(ratios))  # fmt: skip


def table(report: dict[str, Any]) -> str:
    results, ratios, workload = report["results"], report["ratios"], report["workload"]
    rows = [
        [config, r["marked_requests"], r["ttft_marked_mean_s"], r["ttft_marked_p90_s"], r["cache_read_tokens"],
         r["cache_creation_tokens"], r["unpinned_breakpoints"], r["pinned_block_seconds"], r["pool_cycles"],
         r["ttft_unmarked_mean_s"]]
        for config, r in results.items()
    ]  # fmt: skip
    headers = ["config", "marked", "ttft mean s", "ttft p90 s", "cache read", "cache created", "unpinned",
               "pinned block·s", "pool cycles", "unmarked ttft s"]  # fmt: skip
    return "\n".join([
        harness.format_table(headers, rows),
        f"marked TTFT honoured / ignored: {ratios['marked_ttft_honoured_over_ignored']:.3f} (mean), "
        f"{ratios['marked_ttft_p90_honoured_over_ignored']:.3f} (p90); unmarked TTFT "
        f"{ratios['unmarked_ttft_honoured_over_ignored']:.3f}; {workload['agents']} agents x "
        f"{workload['turns_per_agent']} turns, a {workload['system_tokens']}-token system prompt, a pool of "
        f"{workload['num_blocks']} blocks; {workload['wall_s']:.0f} s",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return harness.main(parse_args(argv), measure=run, report=report, table=table)


if __name__ == "__main__":
    sys.exit(main())
