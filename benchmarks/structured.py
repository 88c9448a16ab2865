"""Structured outputs: constrained decoding against unconstrained on the same
prompts, what compiling a grammar and masking a step cost, and an agent
workload whose tools and conversation are cached turn after turn.

    .venv/bin/python benchmarks/structured.py --json benchmarks/results/structured.json [--quick]

One daemon, one float32 SmolLM2 engine and one gateway, called on its gRPC API.

- Throughput, at 1, 16 and 64 requests in flight: each constrained kind
  (``json_schema``, ``regex``, ``choice``) runs its chat prompts greedily to
  their natural end, then the same prompts run unconstrained with each
  request held to the length its constrained twin produced (``ignore_eos``):
  both arms make the same tokens from the same prompts, so their ratio is
  what the grammar and its mask cost. The arms alternate order by round.
  ``unconstrained`` is the plain baseline at the workload's full length.
- Grammar (in this process, with the engine's own ``GrammarCompiler``): the
  time to compile a first-seen schema (the agent's ten tools as a required
  call) and to find it again, and the mask's cost per step and row while a
  JSON document is walked token by token, beside a decode step's time at
  one request in flight.
- Agent: conversations with a long system prompt and ten tools, each turn a
  user question answered by a forced tool call, the call and its result sent
  back, each conversation with a cache salt of its own (turn 1 finds nothing):
  time to first token of later turns against the first, and the share of
  their prompts the cache served.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import harness

KINDS = ("json_schema", "regex", "choice")
CONCURRENCY = (1, 16, 64)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "skills"],
    "additionalProperties": False,
}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
SUBJECTS = ("a baker", "a pilot", "a student", "a nurse", "a gardener", "a judge", "a sailor", "a clerk")
PLACES = ("Lyon", "Porto", "Oslo", "Quito", "Hanoi", "Perth", "Tunis", "Lima")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--rounds", type=int, help="alternating rounds per kind and concurrency (default 3; quick 1)")
    p.add_argument("--max-tokens", type=int, help="the unconstrained baseline's length (default 64; quick 32)")
    p.add_argument("--conversations", type=int, help="agent conversations (default 32; quick 4)")
    p.add_argument("--turns", type=int, default=4, help="agent turns per conversation")
    p.add_argument("--system-tokens", type=int, help="the agent's system prompt (default 2000; quick 500)")
    p.add_argument("--kinds", default=",".join(KINDS), help="constraint kinds measured, comma-separated")
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="requests in flight, comma-separated")
    p.add_argument("--no-agent", action="store_true", help="leave the agent workload out")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--model", default="smollm2")
    args = p.parse_args(argv)
    args.kinds = tuple(k for k in args.kinds.split(",") if k)
    args.concurrency = tuple(int(c) for c in args.concurrency.split(",") if c)
    if unknown := set(args.kinds) - set(KINDS):
        p.error(f"--kinds: unknown {sorted(unknown)}; known: {', '.join(KINDS)}")
    return args


def question(kind: str, i: int) -> str:
    subject, place = SUBJECTS[i % len(SUBJECTS)], PLACES[(i // len(SUBJECTS)) % len(PLACES)]
    if kind == "json_schema":
        return f"Describe {subject} who lives in {place} as a JSON record (request {i})."
    if kind == "regex":
        return f"On what date did {subject} from {place} arrive? Give the date only (request {i})."
    if kind == "choice":
        return f"How does {subject} in {place} feel about the new bridge? (request {i})"
    return f"Tell me about {subject} who lives in {place} (request {i})."


def constraint(kind: str):
    from kvd_api.engine.v1 import engine_pb2 as epb

    if kind == "json_schema":
        return epb.Constraint(json_schema=json.dumps(PERSON))
    if kind == "regex":
        return epb.Constraint(regex=DATE)
    return epb.Constraint(choice=epb.Choices(options=CHOICES))


def one(client, request) -> tuple[int, float, float]:
    """Streams a request: (output tokens, time to first token, total time)."""
    start = time.perf_counter()
    ttft, tokens = None, 0
    for message in client.stub.Generate(request, timeout=1200):
        if ttft is None and message.token_ids:
            ttft = time.perf_counter() - start
        tokens += len(message.token_ids)
    return tokens, ttft or 0.0, time.perf_counter() - start


def batch(client, pool, requests) -> tuple[list[tuple[int, float, float]], float]:
    start = time.perf_counter()
    out = list(pool.map(lambda r: one(client, r), requests))
    return out, time.perf_counter() - start


def chat_request(text: str, **sampling):
    from kvd_api.engine.v1 import engine_pb2 as epb
    from kvd_api.gateway.v1 import gateway_pb2 as pb

    # A salt of its own: no request finds another's prompt in the cache, whichever arm ran first.
    return pb.GenerateRequest(
        chat=epb.ChatPrompt(messages=[epb.ChatMessage(role="user", content=text)]),
        sampling=epb.SamplingParams(**sampling),
        cache_salt=secrets.token_bytes(8),
    )


def throughput(client, args, quick: bool) -> dict[str, Any]:
    """Each kind against its matched unconstrained twin, at each concurrency."""
    rounds = args.rounds or (1 if quick else 3)
    length = args.max_tokens or (32 if quick else 64)
    cap = 160  # a constrained output's most tokens (the schema's fields are bounded)
    rows: dict[str, dict[str, dict[str, list]]] = {}
    progress = harness.Progress("structured: throughput", len(args.concurrency) * rounds * (2 * len(args.kinds) + 1))
    for c in args.concurrency:
        n = max(c, 4)
        lengths: dict[str, list[int]] = {}  # each kind's outputs' lengths (greedy: the same every round)
        with ThreadPoolExecutor(c) as pool:
            for r in range(rounds):
                plain = [chat_request(question("plain", r * 1000 + i), max_new_tokens=length, ignore_eos=True)
                         for i in range(n)]  # fmt: skip
                _add(rows, "unconstrained", c, *batch(client, pool, plain))
                progress.advance()
                for kind in harness.turn_order(args.kinds, r):
                    texts = [question(kind, c + i) for i in range(n)]
                    constrained = [chat_request(t, max_new_tokens=cap, constraint=constraint(kind)) for t in texts]
                    # NOTE: the twin runs first on odd rounds, with the lengths the last round measured.
                    twin_first = kind in lengths
                    if twin_first:
                        twin = batch(client, pool, _twins(texts, lengths[kind]))
                    got, wall = batch(client, pool, constrained)
                    lengths[kind] = [tokens for tokens, _, _ in got]
                    if not twin_first:
                        twin = batch(client, pool, _twins(texts, lengths[kind]))
                    _add(rows, kind, c, got, wall)
                    _add(rows, f"{kind}_matched_unconstrained", c, *twin)
                    progress.advance(2)
    progress.done()
    return {name: {f"c{c}": _summary(per_c[c]) for c in per_c} for name, per_c in rows.items()}


def _twins(texts: list[str], lengths: list[int]) -> list:
    return [chat_request(t, max_new_tokens=n, ignore_eos=True) for t, n in zip(texts, lengths, strict=True)]


def _add(rows, name: str, c: int, got: list[tuple[int, float, float]], wall: float) -> None:
    entry = rows.setdefault(name, {}).setdefault(c, {"got": [], "wall": 0.0})
    entry["got"] += got
    entry["wall"] += wall


def _summary(entry: dict) -> dict[str, float]:
    got = entry["got"]
    tokens = sum(t for t, _, _ in got)
    return {
        "requests": len(got),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / entry["wall"],
        "ttft_p50_s": statistics.median(ttft for _, ttft, _ in got),
        "mean_output_tokens": tokens / len(got),
    }


def agent_tools(rng: random.Random) -> list:
    """Ten tools with parameter schemas of a few typed, bounded fields."""
    from kvd_api.engine.v1 import engine_pb2 as epb

    kinds = [{"type": "string", "maxLength": 30}, {"type": "integer", "minimum": 0, "maximum": 1000},
             {"type": "number"}, {"type": "boolean"}, {"enum": ["low", "medium", "high"]}]  # fmt: skip
    verbs = ("find", "book", "cancel", "list", "check", "send", "update", "track", "convert", "rate")
    nouns = ("flight", "hotel", "order", "invoice", "parcel", "meeting", "ticket", "account", "price", "review")
    tools = []
    for verb, noun in zip(verbs, nouns, strict=True):
        names = rng.sample(["city", "date", "count", "amount", "urgent", "level", "note", "id"], 4)
        properties = {name: rng.choice(kinds) for name in names}
        schema = {"type": "object", "properties": properties, "required": names[:2], "additionalProperties": False}
        tools.append(epb.Tool(name=f"{verb}_{noun}", description=f"{verb.capitalize()} a {noun}.",
                              parameters=json.dumps(schema)))  # fmt: skip
    return tools


def agent(client, tokenizer, args, quick: bool) -> dict[str, Any]:
    """Conversations turn by turn; every conversation's turn t runs before any turn t+1."""
    from kvd_api.engine.v1 import engine_pb2 as epb
    from kvd_api.gateway.v1 import gateway_pb2 as pb

    rng = random.Random(args.seed)
    conversations = args.conversations or (4 if quick else 32)
    system_tokens = args.system_tokens or (500 if quick else 2000)
    system = tokenizer.decode(harness_text_ids(tokenizer, rng, system_tokens))
    tools = agent_tools(rng)
    histories = [[epb.ChatMessage(role="system", content=system)] for _ in range(conversations)]
    # A cache of its own per conversation (as if each were a tenant): turn 1 computes the
    # system prompt and the tools, later turns find them and the conversation so far.
    salts = [secrets.token_bytes(8) for _ in range(conversations)]
    turns: list[list[tuple[int, int, float]]] = []  # per turn: (prompt tokens, cached, ttft)

    def turn(index: int, t: int) -> tuple[int, int, float, pb.GenerateResponse]:
        history = histories[index]
        history.append(
            epb.ChatMessage(role="user", content=f"Step {t + 1} of task {index}: {question('plain', index)}")
        )
        request = pb.GenerateRequest(
            chat=epb.ChatPrompt(messages=history, tools=tools), tool_choice=pb.ToolChoice(required=True),
            sampling=epb.SamplingParams(max_new_tokens=80), cache_salt=salts[index],
        )  # fmt: skip
        start = time.perf_counter()
        ttft, whole = None, pb.GenerateResponse()
        for message in client.stub.Generate(request, timeout=1200):
            if ttft is None and message.token_ids:
                ttft = time.perf_counter() - start
            whole.tool_calls.extend(message.tool_calls)
            if message.HasField("usage"):
                whole.usage.CopyFrom(message.usage)
        calls = list(whole.tool_calls)
        history.append(epb.ChatMessage(role="assistant", tool_calls=calls))
        for call in calls:
            history.append(epb.ChatMessage(role="tool", tool_call_id=call.id, content='{"status": "done"}'))
        return whole.usage.prompt_tokens, whole.usage.cached_prompt_tokens, ttft or 0.0, whole

    progress = harness.Progress("structured: agent turns", args.turns * conversations)
    with ThreadPoolExecutor(8) as pool:
        for t in range(args.turns):
            results = list(pool.map(lambda i, t=t: turn(i, t), range(conversations)))
            turns.append([(p, c, ttft) for p, c, ttft, _ in results])
            progress.advance(conversations)
    progress.done()
    later = [row for rows in turns[1:] for row in rows]
    return {
        "conversations": conversations,
        "system_tokens": system_tokens,
        "tools": len(tools),
        "turn1_ttft_s": statistics.mean(ttft for _, _, ttft in turns[0]),
        "later_turns_ttft_s": statistics.mean(ttft for _, _, ttft in later),
        "turn_ttft_s": [statistics.mean(ttft for _, _, ttft in rows) for rows in turns],
        "turn_prompt_tokens": [statistics.mean(p for p, _, _ in rows) for rows in turns],
        "cached_token_ratio": sum(c for _, c, _ in later) / sum(p for p, _, _ in later),
        "turn1_cached_token_ratio": sum(c for _, c, _ in turns[0]) / sum(p for p, _, _ in turns[0]),
    }


def harness_text_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    from harness.text import english_like, exact_tokens

    return exact_tokens(tokenizer, english_like(rng, 4), n, rng)


def grammar_costs(tokenizer, vocab_size: int, eos: list[int], tools) -> dict[str, float]:
    """Compile times and the mask's cost per step, with the engine's own classes."""
    import torch

    from gateway import tool_calls
    from inference.constraints import Constraint, GrammarCompiler, mask_logits
    from kvd_api.engine.v1 import engine_pb2 as epb
    from kvd_api.gateway.v1 import gateway_pb2 as pb

    compiler = GrammarCompiler(tokenizer, vocab_size, eos)
    sampling = epb.SamplingParams()
    request = pb.GenerateRequest(chat=epb.ChatPrompt(tools=tools), tool_choice=pb.ToolChoice(required=True))
    tool_calls.constrain(sampling, request)
    big = Constraint.from_pb(sampling.constraint)
    start = time.perf_counter()
    compiler.state(big)
    first = time.perf_counter() - start
    cached = []
    for _ in range(20):
        start = time.perf_counter()
        compiler.state(big)
        cached.append(time.perf_counter() - start)
    person = compiler.state(Constraint.from_pb(epb.Constraint(json_schema=json.dumps(PERSON))))
    document = json.dumps({"name": "Ana Lima", "age": 41, "city": "Porto", "skills": ["baking", "maps"]})
    ids = tokenizer.encode(document, add_special_tokens=False)
    logits = torch.randn(1, vocab_size)
    steps = []
    for token in ids:
        start = time.perf_counter()
        mask_logits(logits.clone(), [person])
        steps.append(time.perf_counter() - start)
        person.accept(token)
    return {
        "compile_first_s": first,
        "compile_cached_s": statistics.median(cached),
        "mask_us_per_step": 1e6 * statistics.median(steps),
        "mask_steps": len(steps),
    }


def pool_blocks(args: argparse.Namespace, quick: bool) -> int:
    """Blocks of 16 tokens for every agent conversation whole at once (each has a cache of its
    own: an evicted one would be computed again, measuring the pool instead of the cache)."""
    conversations = args.conversations or (4 if quick else 32)
    system_tokens = args.system_tokens or (500 if quick else 2000)
    per_conversation = -(-(system_tokens + 2048) // 16)  # the tools and four turns fit in 2,048 tokens
    return max(4096, conversations * per_conversation + 1024)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from gateway.client import GatewayClient
    from inference import model_store

    quick = args.quick
    model_dir = model_store.resolve_model(args.model, model_store.default_cache_dir())
    tokenizer = model_store.load_tokenizer(model_dir)
    config = model_store.load_config(model_dir)
    rng = random.Random(args.seed)
    with (
        harness.DaemonProcess(workdir, ["--block-size", "16", "--num-blocks", str(pool_blocks(args, quick))]) as kvd,
        harness.EngineProcess(workdir, kvd.address, ["--model", str(model_dir), "--max-num-seqs", "64"]) as engine,
        harness.GatewayProcess(workdir, engine.address) as gateway,
        GatewayClient(gateway.address, timeout_s=1200) as client,
    ):
        one(client, chat_request("Warm up.", max_new_tokens=4, constraint=constraint("json_schema")))
        results = throughput(client, args, quick)
        if not args.no_agent:
            results["agent"] = agent(client, tokenizer, args, quick)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    results["grammar"] = grammar_costs(tokenizer, config.vocab_size, eos, agent_tools(rng))
    if "c1" in results["unconstrained"]:
        results["grammar"]["decode_step_us_c1"] = 1e6 / results["unconstrained"]["c1"]["output_tokens_per_s"]
    workload = {
        "model": model_dir.name,
        "dtype": "float32",
        "kinds": {"json_schema": PERSON, "regex": DATE, "choice": CHOICES},
        "concurrency": list(args.concurrency),
        "kinds_measured": list(args.kinds),
        "rounds": args.rounds or (1 if quick else 3),
        "cache": "every throughput request has a cache salt of its own (no arm reuses the other's prompts)",
        "unconstrained_tokens": args.max_tokens or (32 if quick else 64),
        "matched": "each constrained kind's twin: the same prompts unconstrained, each held to its twin's length",
        "agent_turns": args.turns,
        "grammar_library": "xgrammar",
        "seed": args.seed,
    }
    return {"workload": workload, "results": results}


def report(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    results = out["results"]
    per_kind = {
        f"{kind}_c{c}": results[kind][f"c{c}"]["output_tokens_per_s"]
        / results[f"{kind}_matched_unconstrained"][f"c{c}"]["output_tokens_per_s"]
        for kind in KINDS
        for c in CONCURRENCY
        if kind in results and f"c{c}" in results[kind]
    }
    grammar = results["grammar"]
    ratios = {
        "worst_constrained_over_unconstrained_tokens_per_s": min(per_kind.values()),
        "constrained_over_matched_unconstrained": per_kind,
    }
    if "decode_step_us_c1" in grammar:
        ratios["mask_share_of_decode_step_c1"] = grammar["mask_us_per_step"] / grammar["decode_step_us_c1"]
    if (agent := results.get("agent")) is not None:
        ratios["agent_later_over_first_ttft"] = agent["later_turns_ttft_s"] / agent["turn1_ttft_s"]
    return harness.stack_report("structured", args.quick, out["workload"], harness.rounded(results),
                                harness.rounded(ratios))  # fmt: skip


def table(report: dict[str, Any]) -> str:
    results, ratios = report["results"], report["ratios"]
    per_kind = ratios["constrained_over_matched_unconstrained"]
    rows = []
    for key, ratio in per_kind.items():
        kind, c = key.rsplit("_c", 1)
        mine, twin = results[kind][f"c{c}"], results[f"{kind}_matched_unconstrained"][f"c{c}"]
        rows.append([kind, c, mine["mean_output_tokens"], mine["output_tokens_per_s"], twin["output_tokens_per_s"],
                     ratio, mine["ttft_p50_s"], twin["ttft_p50_s"]])  # fmt: skip
    grammar = results["grammar"]
    lines = [
        harness.format_table(
            ["kind", "in flight", "tokens/req", "tok/s", "twin tok/s", "ratio", "ttft p50", "twin ttft p50"], rows
        ),  # fmt: skip
        f"worst constrained / unconstrained tokens/s: {ratios['worst_constrained_over_unconstrained_tokens_per_s']:.3f}"
        " (target >= 0.9)",
        f"grammar: first compile {grammar['compile_first_s'] * 1e3:.1f} ms,"
        f" cached {grammar['compile_cached_s'] * 1e3:.2f} ms; mask {grammar['mask_us_per_step']:.0f} us per step"
        " and row",
    ]
    if "mask_share_of_decode_step_c1" in ratios:
        lines[-1] += (f" against a {grammar['decode_step_us_c1']:.0f} us decode step"
                      f" ({ratios['mask_share_of_decode_step_c1']:.2%})")  # fmt: skip
    if (agent := results.get("agent")) is not None:
        lines.append(
            f"agent: turn 1 TTFT {agent['turn1_ttft_s']:.3f} s, later turns {agent['later_turns_ttft_s']:.3f} s"
            f" ({ratios['agent_later_over_first_ttft']:.2f}x); cached share of later turns' prompts"
            f" {agent['cached_token_ratio']:.2%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return harness.main(parse_args(argv), measure=run, report=report, table=table)


if __name__ == "__main__":
    sys.exit(main())
