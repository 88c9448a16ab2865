"""End-to-end benchmark: a shared-prefix workload through four ways of serving it.

SmolLM2-135M-Instruct, float32, on the CPU (``--device cuda`` with a model
folder: the GPU run, see benchmarks/gpu_e2e.sh). The workload (seeded, real text):
16 requests, each one ~600-token document prefix (the same for all) + a
distinct ~40-token question, 32 greedy new tokens (EOS disabled), all
submitted at once (t = 0). Four variants, side by side in one run:

    hf_generate             transformers' ``model.generate``, one request at a time;
    hf_continuous_batching  transformers' own continuous batching (the manager
                            behind ``generate_batch``: paged cache, prefix
                            sharing on), in this process;
    kvd_no_cache            a kvd daemon + engine subprocess, prefix caching off;
    kvd                     the same with prefix caching on.

Each reports total seconds (t = 0 to the last request's last token), output
tokens/s, mean and p90 time to first token (from t = 0, so queueing counts)
and the cached share of prompt tokens. hf_generate runs once; the other three
take turns for ``--rounds`` rounds (default 3) and report medians, since this
machine's speed drifts by 10-20% from one minute to the next. Then, on the
``kvd`` engine, the time to first token of a request whose 1,000-token prefix
is cold, then warm (same prefix, another suffix), for a few distinct prefixes
(medians).

Every variant gets one short warm-up request first (not timed, sharing no
prefix with the workload). The greedy outputs of every variant are compared
with ``hf_generate``'s (``tokens_match_hf_generate``).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/e2e.py --json FILE [--quick] [--plot FILE]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# NOTE: before torch loads OpenMP (see inference/cli.py): spinning OpenMP
# workers cost several times per step when processes share two cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import _common as common  # noqa: E402
import grpc  # noqa: E402
import torch  # noqa: E402

from inference import model_store  # noqa: E402
from kvd_api.engine.v1 import engine_pb2 as pb  # noqa: E402
from kvd_api.engine.v1 import engine_pb2_grpc as pb_grpc  # noqa: E402

VARIANTS = ("hf_generate", "hf_continuous_batching", "kvd_no_cache", "kvd")
ENGINE_VARIANTS = ("kvd_no_cache", "kvd")
METRICS = ("total_s", "output_tokens_per_s", "ttft_mean_s", "ttft_p90_s", "cached_token_ratio")
BLOCK_SIZE = 16
#: The engine's default --token-budget; transformers' continuous batching gets
#: the same as its max_batch_tokens. Its default, 8192, puts every prompt in one
#: forward whose attention mask is quadratic in it: 8 x 640-token prompts took
#: 36.6 s instead of 5.7-7.9 s on this machine (256: 7.7 s, 1024: 10.1 s).
TOKEN_BUDGET = 512
RPC_TIMEOUT_S = 900.0

FULL = {
    "requests": 16,
    "prefix_tokens": 600,
    "question_tokens": 40,
    "new_tokens": 32,
    "warm_cold_prefix_tokens": 1000,
    "warm_cold_suffix_tokens": 16,
    "warm_cold_new_tokens": 4,
    "warm_cold_repeats": 3,
}
#: The GPU's larger workload (benchmarks/gpu_e2e.sh OUT TOKENIZER --workload large).
LARGE = {
    "requests": 256,
    "prefix_tokens": 2000,
    "question_tokens": 100,
    "new_tokens": 128,
    "warm_cold_prefix_tokens": 2000,
    "warm_cold_suffix_tokens": 100,
    "warm_cold_new_tokens": 4,
    "warm_cold_repeats": 3,
}
WORKLOADS = {"default": FULL, "large": LARGE}
QUICK = {
    "requests": 4,
    "prefix_tokens": 200,
    "question_tokens": 40,
    "new_tokens": 8,
    "warm_cold_prefix_tokens": 500,
    "warm_cold_suffix_tokens": 16,
    "warm_cold_new_tokens": 2,
    "warm_cold_repeats": 1,
}

# ------------------------------------------------------------------- text

INSTRUCTION = "Read the following report carefully, then answer the question that comes after it.\n\n"

#: The shared document (~640 tokens with the SmolLM2 tokenizer); cut to the
#: workload's prefix length in tokens (extended with seeded text if short).
DOCUMENT = """\
Annual Report of the Harbor Valley Water Cooperative

The Harbor Valley Water Cooperative was founded in 1961 by eleven farming families who \
shared a single well on the northern slope of the valley. Today it serves about 48,000 \
people in four towns, maintains 312 kilometres of pipe, and operates two treatment plants: \
the older Millbrook plant, which draws from the river, and the Stonegate plant, which \
draws from three deep aquifer wells opened in 2009.

Over the past year the cooperative delivered 9.4 million cubic metres of drinking water, \
a decrease of 3 percent compared with the year before. Most of the saving came from \
repairs. A survey with acoustic sensors found 214 leaks in the oldest part of the network, \
under the town of Eastbridge, where many cast-iron mains date from the 1930s. Crews fixed \
190 of them before the winter, and the board estimates that the repairs save roughly \
600 cubic metres a day.

Water quality stayed within every national limit. The laboratory ran 11,200 tests, and \
only two samples showed elevated turbidity, both after the storm of 14 March, when the \
river carried heavy sediment for three days. During that storm the Millbrook plant \
reduced its intake and the Stonegate wells supplied two thirds of the demand. No boil-water \
notice was needed, but the event convinced the board to build a second settling basin at \
Millbrook, which is planned for the spring of next year at a cost of 2.1 million.

Prices rose by 4.5 percent on 1 January, the first increase in three years. The board \
explained that electricity for the pumps now costs almost twice what it did five years ago, \
and that the loan for the Stonegate wells must be repaid by 2029. Households that use less \
than 80 litres per person per day pay the lowest tier, which did not change. A new \
assistance fund, paid for by a small charge on the highest tier, helped 380 families \
with their bills.

The cooperative employs 64 people. Eight new technicians were hired, half of them from \
the apprenticeship programme run with the Eastbridge technical college. Staff completed \
2,900 hours of training, mostly on the new network monitoring software, which shows \
pressure and flow for every district on one screen and sends an alert when a reading \
changes suddenly.

Looking ahead, the board has set three goals for the next five years. First, to replace \
all remaining cast-iron mains under Eastbridge, about 41 kilometres, at a rate of eight \
kilometres a year. Second, to cut the energy used per cubic metre by a fifth, with solar \
panels on the roofs of both plants and with variable-speed pumps. Third, to protect the \
aquifer by buying and replanting 150 hectares of land around the Stonegate wells, where \
fertiliser from nearby fields has slowly raised the level of nitrate in the water.

Members may read the full accounts at the cooperative office on Quay Street, and the \
annual meeting will take place on the second Tuesday of June in the Millbrook community hall.
"""

#: One question per request (cycled with a number when there are more requests).
QUESTIONS = (
    "In which year was the cooperative founded, and by how many families?",
    "How many people does the cooperative serve today, and in how many towns?",
    "What are the names of the two treatment plants, and where does each draw its water from?",
    "How much drinking water was delivered over the past year, and how did it compare with the year before?",
    "How many leaks did the acoustic survey find, and how many of them were fixed before the winter?",
    "Why are there so many leaks under the town of Eastbridge?",
    "What happened to water quality after the storm of 14 March?",
    "How did the two plants share the demand during the storm?",
    "What will the second settling basin at Millbrook cost, and when will it be built?",
    "By how much did prices rise on 1 January, and what reasons did the board give?",
    "Which households were not affected by the price increase?",
    "How is the new assistance fund paid for, and how many families did it help?",
    "How many people does the cooperative employ, and where did the new technicians come from?",
    "What does the new network monitoring software show, and when does it send an alert?",
    "What are the three goals the board has set for the next five years?",
    "Why does the cooperative want to buy and replant land around the Stonegate wells?",
)
QUESTION_TAIL = "\nAnswer in one or two sentences.\nAnswer:"

_SUBJECTS = (
    "the committee", "the old engineer", "a small team", "the river authority", "the new survey", "the city council",
    "a local farmer", "the morning report", "the finance office", "the field crew", "a visiting inspector",
    "the north district", "the harbour master", "the regional board", "the night shift", "the school",
)  # fmt: skip
_VERBS = (
    "reviewed", "measured", "described", "repaired", "questioned", "approved", "recorded", "compared",
    "postponed", "explained", "inspected", "announced", "rejected", "planned", "studied", "replaced",
)  # fmt: skip
_OBJECTS = (
    "the pumping schedule", "a damaged valve", "the spring rainfall", "the budget for roads", "the bridge repairs",
    "a map of the wells", "the price of electricity", "the winter timetable", "an unusual sample", "the new pipes",
    "the flood barrier", "the annual accounts", "a long delay", "the quality of the soil", "the evening traffic",
)  # fmt: skip
_ENDINGS = (
    "before the end of the month", "after a long discussion", "with some difficulty", "for the second time",
    "without much support", "in the presence of the press", "as the weather improved", "during the holiday",
    "on the advice of the mayor", "while the plant was closed", "at the request of residents", "in great detail",
)  # fmt: skip


def english_like(rng: random.Random, sentences: int) -> str:
    """Seeded English-like prose (simple sentences from word lists)."""
    out = []
    for _ in range(sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."
        out.append(s[0].upper() + s[1:])
        if rng.random() < 0.15:
            out.append("\n\n")
    return " ".join(out).replace(" \n\n ", "\n\n")


def exact_tokens(tokenizer, text: str, n: int, rng: random.Random, ids: list[int] | None = None) -> list[int]:
    """``text`` (or token ``ids``) as exactly ``n`` tokens: cut, or extended with seeded prose."""
    ids = list(ids) if ids is not None else tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids += tokenizer.encode(" " + english_like(rng, 8), add_special_tokens=False)
    return ids[:n]


@dataclass
class Workload:
    prompts: list[list[int]]
    prefix: list[int]
    warm_cold: list[tuple[list[int], list[int], list[int]]]  # (prefix, cold suffix, warm suffix)
    warmup: list[int]
    params: dict[str, Any]


def build_workload(tokenizer, sizes: dict[str, int], seed: int) -> Workload:
    rng_seed = f"e2e/{seed}"
    rng = random.Random(rng_seed)
    prefix = exact_tokens(tokenizer, INSTRUCTION + DOCUMENT, sizes["prefix_tokens"], rng)
    tail = tokenizer.encode(QUESTION_TAIL, add_special_tokens=False)
    prompts = []
    for i in range(sizes["requests"]):
        question = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            question += f" (variant {i // len(QUESTIONS) + 1})"
        head = tokenizer.encode(f"\n\nQuestion {i + 1}: {question}", add_special_tokens=False)
        body = sizes["question_tokens"] - len(tail)
        pad = tokenizer.encode(" Be specific and quote numbers from the report.", add_special_tokens=False)
        while len(head) < body:
            head += pad
        prompts.append(prefix + head[:body] + tail)
    if len({tuple(p) for p in prompts}) != len(prompts):
        raise RuntimeError("the workload's prompts are not distinct")
    warm_cold = []
    for r in range(sizes["warm_cold_repeats"]):
        wc_rng = random.Random(f"{rng_seed}/warm_cold/{r}")
        head = f"Background notes, file {r + 1}.\n\n"
        wc_prefix = exact_tokens(tokenizer, head + english_like(wc_rng, 10), sizes["warm_cold_prefix_tokens"], wc_rng)
        suffixes = []
        for kind in ("first", "second"):
            head = tokenizer.encode(f"\n\nQuestion ({kind}): {english_like(wc_rng, 1)}", add_special_tokens=False)
            end = tokenizer.encode(" Why?\nAnswer:", add_special_tokens=False)
            suffixes.append(
                exact_tokens(tokenizer, "", sizes["warm_cold_suffix_tokens"] - len(end), wc_rng, head) + end
            )
        warm_cold.append((wc_prefix, suffixes[0], suffixes[1]))
    warmup = tokenizer.encode("Warm-up: name three colours of the rainbow.", add_special_tokens=False)
    params = {
        **sizes,
        "seed": seed,
        "rng_seed": rng_seed,
        "prompt_tokens": [len(p) for p in prompts],
        "shared_prefix_tokens": len(prefix),
        "text": "a hand-written ~640-token report (DOCUMENT in e2e.py) cut to prefix_tokens; hand-written "
        "questions padded/cut to question_tokens; warm/cold prefixes: seeded English-like prose",
        "prompt_format": "token ids (no chat template): instruction + document, then 'Question N: ... Answer:'",
        "warmup_prompt_tokens": len(warmup),
    }
    return Workload(prompts, prefix, warm_cold, warmup, params)


# ------------------------------------------------------------------- runs


@dataclass
class Run:
    """One variant's pass over the workload: per request, in workload order."""

    total_s: float = math.nan
    ttft_s: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        output = sum(len(t) for t in self.tokens)
        return {
            "total_s": self.total_s,
            "output_tokens_per_s": output / self.total_s,
            "ttft_mean_s": common.mean(self.ttft_s),
            "ttft_p90_s": common.percentile(self.ttft_s, 90),
            "cached_token_ratio": sum(self.cached_tokens) / sum(self.prompt_tokens),
            "ttft_p50_s": common.median(self.ttft_s),
            "ttft_max_s": max(self.ttft_s),
            "output_tokens": output,
            "prompt_tokens": sum(self.prompt_tokens),
            "cached_tokens": sum(self.cached_tokens),
            "requests": len(self.tokens),
            **self.extra,
            "per_request": {"ttft_s": self.ttft_s, "cached_tokens": self.cached_tokens},
        }


def combine_rounds(runs: list[Run]) -> dict[str, Any]:
    """One variant over its rounds: each metric's median, the median round's
    details (per request), and every round's headline figures."""
    summaries = [run.summary() for run in runs]
    middle = sorted(summaries, key=lambda s: s["total_s"])[(len(summaries) - 1) // 2]
    combined = {**middle, **{m: common.median([s[m] for s in summaries]) for m in METRICS}}
    combined["rounds"] = [{m: s[m] for m in METRICS} for s in summaries]
    return combined


class FirstTokenTimer:
    """A ``generate`` streamer that notes when the first new token exists.

    ``generate`` calls ``put`` once with the prompt, then once per sampled
    token, on the CPU right after that token is sampled (its ``StopCheck``):
    the second call is the first token, at no extra compute.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def hf_greedy(model, prompt: list[int], new_tokens: int, streamer=None) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # else prompt tokens equal to the pad id are masked out
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
        streamer=streamer,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def run_hf_generate(model, w: Workload, new_tokens: int) -> Run:
    """One request at a time, in order; all were submitted at t = 0, so request
    i's time to first token includes the time spent on requests 0..i-1."""
    hf_greedy(model, w.warmup, 4)
    run = Run()
    progress = common.Progress("hf_generate", len(w.prompts))
    t0 = time.perf_counter()
    for prompt in w.prompts:
        timer = FirstTokenTimer()
        run.tokens.append(hf_greedy(model, prompt, new_tokens, timer))
        assert timer.first_token_at is not None
        run.ttft_s.append(timer.first_token_at - t0)
        run.prompt_tokens.append(len(prompt))
        run.cached_tokens.append(0)
        progress.advance()
    run.total_s = time.perf_counter() - t0
    progress.done()
    return run


def hf_cb_config(num_blocks: int, token_budget: int = TOKEN_BUDGET):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_batch_tokens=token_budget,
        allow_block_sharing=True,
        seed=0,
    )


@torch.no_grad()  # not inference_mode: the manager's thread updates tensors created here in place
def run_hf_continuous_batching(
    model, w: Workload, new_tokens: int, num_blocks: int, token_budget: int = TOKEN_BUDGET
) -> Run:
    """transformers' continuous batching through its manager (what ``generate_batch``
    runs: ``init_continuous_batching``, ``warmup``, ``start``, ``add_requests``,
    ``get_result`` until all finished), so that its one-time set-up is not timed
    (the engines' start-up is not either) and each request's tokens carry
    timestamps (``record_timestamps``): TTFT = first token's timestamp - t0.
    Prefix sharing is counted by wrapping the cache's ``search_prefix_match``.
    """
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,  # the manager turns None into -1: EOS disabled
        pad_token_id=model.config.pad_token_id,
    )
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=hf_cb_config(num_blocks, token_budget)
    )
    run = Run()
    try:
        manager.warmup()  # creates the batch processor and its paged cache (CUDA graphs only on a GPU)
        cache = manager.batch_processor.cache
        matched: dict[str, int] = {}
        search = cache.search_prefix_match

        def counting_search(request_id: str, prompt_ids: list[int]) -> int:
            n = search(request_id, prompt_ids)
            matched[request_id] = max(matched.get(request_id, 0), n)
            return n

        cache.search_prefix_match = counting_search
        manager.start()
        _cb_collect(manager, manager.add_requests([w.warmup], max_new_tokens=4), timeout_s=RPC_TIMEOUT_S)
        matched.clear()
        progress = common.Progress("hf_continuous_batching", len(w.prompts))
        t0 = time.perf_counter()
        ids = manager.add_requests(w.prompts, max_new_tokens=new_tokens, record_timestamps=True)
        results = _cb_collect(manager, ids, RPC_TIMEOUT_S, progress)
        run.total_s = time.perf_counter() - t0
        progress.done()
        for rid, prompt in zip(ids, w.prompts, strict=True):
            r = results[rid]
            if r.error is not None:
                raise RuntimeError(f"{rid} failed: {r.error}")
            run.tokens.append(list(r.generated_tokens))
            run.ttft_s.append(r.timestamps[0] - t0)
            run.prompt_tokens.append(len(prompt))
            run.cached_tokens.append(matched.get(rid, 0))
        run.extra.update(
            attn_implementation=model.config._attn_implementation,
            use_prefix_sharing=bool(cache.use_prefix_sharing),
            max_batch_tokens=cache.max_batch_tokens,
            cache_num_blocks=cache.num_blocks,
        )
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    return run


def _cb_collect(manager, ids: list[str], timeout_s: float, progress: common.Progress | None = None) -> dict[str, Any]:
    pending, results = set(ids), {}
    deadline = time.perf_counter() + timeout_s
    while pending:
        if time.perf_counter() > deadline or not manager.is_running():
            raise RuntimeError(f"continuous batching stopped with {len(pending)} requests unfinished")
        r = manager.get_result(timeout=1)
        if r is not None and r.is_finished() and r.request_id in pending:
            pending.discard(r.request_id)
            results[r.request_id] = r
            if progress is not None:
                progress.advance()
    return results


# ------------------------------------------------------------------ engines


@dataclass
class Stream:
    """One Generate call as the client saw it."""

    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    finished_at: float | None = None
    usage: Any = None
    error: str | None = None


def engine_request(prompt: list[int], new_tokens: int, salt: bytes = b"") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True),  # greedy: no temperature
        cache_salt=salt,
    )


def stream(stub, prompt: list[int], new_tokens: int, salt: bytes = b"") -> Stream:
    s = Stream()
    try:
        for message in stub.Generate(engine_request(prompt, new_tokens, salt), timeout=RPC_TIMEOUT_S):
            if message.token_ids and s.first_token_at is None:
                s.first_token_at = time.perf_counter()
            s.tokens.extend(message.token_ids)
            if message.HasField("usage"):
                s.usage = message.usage
        s.finished_at = time.perf_counter()
        if s.usage is None:
            s.error = "the stream ended without usage"
    except grpc.RpcError as err:
        s.error = f"{err.code().name}: {err.details()}"
    return s


def run_concurrent(stub, label: str, prompts: list[list[int]], new_tokens: int, salt: bytes) -> Run:
    """Every prompt in its own thread, released together at t = 0; TTFT is the
    client's: t0 to the first streamed message with tokens. The cache salt
    keeps one round's blocks from serving the next (each round starts cold)."""
    streams: list[Stream | None] = [None] * len(prompts)
    go = threading.Event()
    lock = threading.Lock()
    progress = common.Progress(label, len(prompts))

    def worker(i: int) -> None:
        go.wait()
        streams[i] = stream(stub, prompts[i], new_tokens, salt)
        with lock:
            progress.advance()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    time.sleep(0.2)  # every thread is parked on the event
    t0 = time.perf_counter()
    go.set()
    for t in threads:
        t.join(RPC_TIMEOUT_S + 30)
    progress.done()
    errors = [s.error if s is not None else "no result" for s in streams if s is None or s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(prompts)} requests failed: {errors[0]}")
    run = Run()
    run.total_s = max(s.finished_at for s in streams) - t0
    for s in streams:
        run.tokens.append(s.tokens)
        run.ttft_s.append(s.first_token_at - t0)
        run.prompt_tokens.append(s.usage.prompt_tokens)
        run.cached_tokens.append(s.usage.cached_prompt_tokens)
    server_ttft = [s.usage.time_to_first_token_s for s in streams]
    run.extra.update(server_ttft_mean_s=common.mean(server_ttft), server_ttft_p90_s=common.percentile(server_ttft, 90))
    return run


def run_warm_cold(stub, w: Workload, new_tokens: int) -> dict[str, Any]:
    """Per prefix: a cold request (prefix never seen), then a warm one (same
    prefix, another suffix), one at a time on an idle engine."""
    cold, warm, cold_server, warm_server, warm_cached, cold_cached = [], [], [], [], [], []
    progress = common.Progress("kvd warm/cold", 2 * len(w.warm_cold))
    for prefix, cold_suffix, warm_suffix in w.warm_cold:
        for suffix, ttft, server, cached in (
            (cold_suffix, cold, cold_server, cold_cached),
            (warm_suffix, warm, warm_server, warm_cached),
        ):
            t0 = time.perf_counter()
            s = stream(stub, prefix + suffix, new_tokens)
            if s.error:
                raise RuntimeError(f"warm/cold request failed: {s.error}")
            ttft.append(s.first_token_at - t0)
            server.append(s.usage.time_to_first_token_s)
            cached.append(s.usage.cached_prompt_tokens)
            progress.advance()
    progress.done()
    return {
        "ttft_cold_s": common.median(cold),
        "ttft_warm_s": common.median(warm),
        "prefix_tokens": len(w.warm_cold[0][0]),
        "suffix_tokens": len(w.warm_cold[0][1]),
        "repeats": len(cold),
        "ttft_cold_all_s": cold,
        "ttft_warm_all_s": warm,
        "server_ttft_cold_s": common.median(cold_server),
        "server_ttft_warm_s": common.median(warm_server),
        "cached_tokens_cold": cold_cached,
        "cached_tokens_warm": warm_cached,
    }


class EngineVariant:
    """A kvd daemon and engine serving one variant for every round: started
    by ``start``, stopped by ``stop``."""

    def __init__(
        self,
        name: str,
        model_path: Path,
        num_blocks: int,
        prefix_caching: bool,
        workdir: str,
        device: str,
        dtype: str,
        token_budget: int = TOKEN_BUDGET,
        max_num_seqs: int = 64,
    ) -> None:
        self.name = name
        folder = os.path.join(workdir, name)
        os.makedirs(folder, exist_ok=True)
        daemon_flags = [
            "--metrics-port", "0", "--block-size", str(BLOCK_SIZE), "--num-blocks", str(num_blocks),
            "--device", device, "--log-level", "warning",
        ]  # fmt: skip
        engine_flags = ["--model", str(model_path), "--dtype", dtype, "--device", device]
        engine_flags += ["--token-budget", str(token_budget), "--max-num-seqs", str(max_num_seqs)]
        if not prefix_caching:
            engine_flags.append("--no-prefix-caching")
        self.workdir = workdir
        self.daemon = common.KvdProcess(folder, daemon_flags, name="kvd")
        self.engine = common.EngineProcess(folder, self.daemon.address, engine_flags, name="engine")
        self.channel = None
        self.stub = None

    def start(self, warmup: list[int]) -> dict[str, Any]:
        """Starts both processes and sends one untimed warm-up request.

        Returns:
            How they were launched (for the report).
        """
        self.daemon.start()
        self.engine.start()
        self.channel = grpc.insecure_channel(self.engine.address)
        self.stub = pb_grpc.EngineStub(self.channel)
        warm = stream(self.stub, warmup, 4)
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        return {
            "variant": self.name,
            "daemon": " ".join(self.daemon.command).replace(self.workdir, "<tmpdir>"),
            "engine": " ".join(self.engine.command).replace(self.workdir, "<tmpdir>").replace(sys.executable, "python"),
            "engine_startup_s": round(self.engine.startup_s, 2),
        }

    def run(self, w: Workload, new_tokens: int, round_index: int) -> Run:
        run = run_concurrent(self.stub, self.name, w.prompts, new_tokens, f"e2e-round-{round_index}".encode())
        if self.engine.proc is None or self.engine.proc.poll() is not None:
            raise RuntimeError("the engine exited")
        return run

    def warm_cold(self, w: Workload, new_tokens: int) -> dict[str, Any]:
        return run_warm_cold(self.stub, w, new_tokens)

    def logs(self) -> str:
        return f"--- engine log ---\n{self.engine.log_tail()}\n--- kvd log ---\n{self.daemon.log_tail()}"

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.engine.stop()
        self.daemon.stop()


# ------------------------------------------------------------------ report


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Greedy outputs against hf_generate's: identical requests, and the mean
    share of each output before its first differing token."""
    same, shares = 0, []
    for a, b in zip(tokens, reference, strict=True):
        same += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        shares.append(n / max(1, len(b)))
    return {"tokens_match_hf_generate": same / len(reference), "matching_prefix_share": common.mean(shares)}


def build_ratios(results: dict[str, Any]) -> dict[str, float | None]:
    def get(variant: str, metric: str) -> float | None:
        return (results.get(variant) or {}).get(metric)

    warm_cold = results.get("warm_cold") or {}
    return {
        "throughput_vs_hf_cb": common.ratio(
            get("kvd", "output_tokens_per_s"), get("hf_continuous_batching", "output_tokens_per_s")
        ),
        "ttft_vs_hf_cb": common.ratio(get("kvd", "ttft_mean_s"), get("hf_continuous_batching", "ttft_mean_s")),
        "warm_over_cold": common.ratio(warm_cold.get("ttft_warm_s"), warm_cold.get("ttft_cold_s")),
        "throughput_vs_hf_generate": common.ratio(
            get("kvd", "output_tokens_per_s"), get("hf_generate", "output_tokens_per_s")
        ),
        "throughput_vs_kvd_no_cache": common.ratio(
            get("kvd", "output_tokens_per_s"), get("kvd_no_cache", "output_tokens_per_s")
        ),
        "ttft_vs_kvd_no_cache": common.ratio(get("kvd", "ttft_mean_s"), get("kvd_no_cache", "ttft_mean_s")),
        "hf_cb_throughput_vs_hf_generate": common.ratio(
            get("hf_continuous_batching", "output_tokens_per_s"), get("hf_generate", "output_tokens_per_s")
        ),
    }


def paired_ratios(results: dict[str, Any]) -> dict[str, list[float]]:
    """The target ratios of each round on its own (kvd against the
    continuous batching run just before it)."""
    cb = (results.get("hf_continuous_batching") or {}).get("rounds") or []
    kvd = (results.get("kvd") or {}).get("rounds") or []
    if not cb or len(cb) != len(kvd):
        return {}
    pairs = list(zip(kvd, cb, strict=True))
    return {
        "throughput_vs_hf_cb": [k["output_tokens_per_s"] / c["output_tokens_per_s"] for k, c in pairs],
        "ttft_vs_hf_cb": [k["ttft_mean_s"] / c["ttft_mean_s"] for k, c in pairs],
    }


TARGETS = {
    "throughput_vs_hf_cb": (">=", 3.0),
    "ttft_vs_hf_cb": ("<=", 0.3),
    "warm_over_cold": ("<=", 0.15),
}


def check_targets(ratios: dict[str, float | None]) -> dict[str, Any]:
    out = {}
    for name, (op, bound) in TARGETS.items():
        value = ratios.get(name)
        met = None if value is None else (value >= bound if op == ">=" else value <= bound)
        out[name] = {"target": f"{op} {bound}", "value": value, "met": met}
    return out


def print_report(results: dict[str, Any], ratios: dict[str, float | None], targets: dict[str, Any]) -> None:
    rows = []
    for v in VARIANTS:
        r = results.get(v)
        if r is None:
            continue
        if "error" in r:
            rows.append([v, *([None] * 6), "ERROR: " + r["error"].splitlines()[0][:60]])
            continue
        match = r.get("tokens_match_hf_generate")
        rows.append(
            [
                v,
                r["total_s"],
                r["output_tokens_per_s"],
                r["ttft_mean_s"],
                r["ttft_p90_s"],
                r["cached_token_ratio"],
                match,
                "",
            ]
        )
    headers = ["variant", "total s", "out tok/s", "TTFT mean s", "TTFT p90 s", "cached", "same as hf_generate", ""]
    print(common.format_table(headers, rows))
    print()
    wc = results.get("warm_cold") or {}
    if "error" in wc:
        print(f"warm/cold: ERROR: {wc['error'].splitlines()[0]}")
    elif wc:
        print(
            common.format_table(
                ["warm/cold", "prefix tokens", "TTFT cold s", "TTFT warm s", "repeats"],
                [["kvd", wc["prefix_tokens"], wc["ttft_cold_s"], wc["ttft_warm_s"], wc["repeats"]]],
            )
        )
    print()
    rows = []
    for name, value in ratios.items():
        t = targets.get(name)
        verdict = "" if t is None else f"target {t['target']}: " + {True: "met", False: "NOT met", None: "-"}[t["met"]]
        rows.append([name, value, verdict])
    print(common.format_table(["ratio", "value", ""], rows))


# ------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--quick", action="store_true", help="4 requests, 200-token prefix, 8 new tokens (about a minute)")
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="default",
        help="default: 16 requests, 600-token prefix, 32 new tokens; large (the GPU's): 256 requests, "
        "2,000-token prefix, ~100-token questions, 128 new tokens (--quick wins over it)",
    )
    p.add_argument(
        "--token-budget",
        type=int,
        default=TOKEN_BUDGET,
        help="the engine's tokens per step and continuous batching's max_batch_tokens",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="the engine's running sequences")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        help="KV blocks of each engine and of continuous batching (default: every request's whole sequence "
        "twice over, no sharing counted; the large workload on a GPU needs less: its prefix is shared)",
    )
    p.add_argument("--plot", help="also write a PNG bar chart (needs matplotlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", help="copy the daemons' and engines' logs into this folder")
    p.add_argument("--model", default="smollm2", help="'smollm2' or a local Hugging Face folder")
    p.add_argument("--device", default="cpu", help="cpu or cuda: the daemon's cache, the engine and the hf baselines")
    p.add_argument("--dtype", default="", help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset to run (default: all four)")
    p.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="rounds of every variant but hf_generate, taking turns (default 3; --quick: 1)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    sizes = dict(QUICK if args.quick else WORKLOADS[args.workload])
    chosen = [v for v in VARIANTS if v in args.variants.split(",")]
    started = time.perf_counter()

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # its "EOS disabled" warning is intended
    model_path = model_store.resolve_model(args.model, model_store.default_cache_dir())
    tokenizer = model_store.load_tokenizer(model_path)
    w = build_workload(tokenizer, sizes, args.seed)
    per_request_blocks = -(-(max(len(p) for p in w.prompts) + sizes["new_tokens"]) // BLOCK_SIZE)
    wc_blocks = -(-(sizes["warm_cold_prefix_tokens"] + sizes["warm_cold_suffix_tokens"] + 8) // BLOCK_SIZE)
    needed = len(w.prompts) * per_request_blocks + 2 * len(w.warm_cold) * wc_blocks + 16
    num_blocks = args.num_blocks or 256 * -(-(2 * needed) // 256)  # room for everything twice over: no eviction

    rounds = args.rounds or (1 if args.quick else 3)
    results: dict[str, Any] = {}
    runs: dict[str, list[Run]] = {}
    failed: dict[str, str] = {}
    launched: list[dict[str, Any]] = []
    model = None
    if "hf_generate" in chosen or "hf_continuous_batching" in chosen:
        model = model_store.load_model(model_path, getattr(torch, dtype), args.device)
    workdir = tempfile.mkdtemp(prefix="kvd-e2e-", dir="/tmp")  # short: unix socket paths are limited
    engines = {
        v: EngineVariant(
            v, model_path, num_blocks, v == "kvd", workdir, args.device, dtype, args.token_budget, args.max_num_seqs
        )
        for v in chosen
        if v in ENGINE_VARIANTS
    }

    def attempt(variant: str, work) -> Any:
        """Runs one piece of a variant's work; a failure is reported, the others go on."""
        if variant in failed:
            return None
        try:
            return work()
        except Exception as exc:
            common.log(f"{variant} FAILED:\n{traceback.format_exc()}")
            logs = engines[variant].logs() if variant in engines else ""
            failed[variant] = f"{type(exc).__name__}: {exc}\n{logs}".strip()
            return None

    try:
        if "hf_generate" in chosen:  # the reference outputs; once (the slowest, and in no target)
            run = attempt("hf_generate", lambda: run_hf_generate(model, w, sizes["new_tokens"]))
            runs["hf_generate"] = [run] if run is not None else []
        for variant, engine in engines.items():
            info = attempt(variant, lambda engine=engine: engine.start(w.warmup))
            if info is not None:
                launched.append(info)
        # The variants in targets take turns, round after round, so a slow
        # spell of this shared machine falls on all of them alike.
        for r in range(rounds):
            for variant in chosen:
                if variant == "hf_generate":
                    continue
                if variant == "hf_continuous_batching":
                    work = lambda: run_hf_continuous_batching(  # noqa: E731
                        model, w, sizes["new_tokens"], num_blocks, args.token_budget
                    )
                else:
                    work = lambda engine=engines[variant], r=r: engine.run(w, sizes["new_tokens"], r)  # noqa: E731
                run = attempt(variant, work)
                if run is not None:
                    runs.setdefault(variant, []).append(run)
        if "kvd" in engines:
            warm_cold = attempt("kvd", lambda: engines["kvd"].warm_cold(w, sizes["warm_cold_new_tokens"]))
            if warm_cold is not None:
                results["warm_cold"] = warm_cold
    finally:
        for engine in engines.values():
            engine.stop()
        if args.logs:
            for log_file in Path(workdir).glob("*/*.log"):
                target = Path(args.logs) / f"{log_file.parent.name}-{log_file.name}"
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(log_file, target)
        shutil.rmtree(workdir, ignore_errors=True)

    reference = (runs.get("hf_generate") or [None])[0]
    for variant in chosen:
        if variant in failed:
            results[variant] = {**dict.fromkeys(METRICS), "error": failed[variant]}
            continue
        results[variant] = combine_rounds(runs[variant])
        results[variant]["all_outputs_full_length"] = all(
            len(t) == sizes["new_tokens"] for run in runs[variant] for t in run.tokens
        )
        if reference is not None:  # the worst round
            shares = [agreement(run.tokens, reference.tokens) for run in runs[variant]]
            worst = min(shares, key=lambda a: (a["tokens_match_hf_generate"], a["matching_prefix_share"]))
            results[variant].update(worst)
    if "kvd" in failed:
        results["warm_cold"] = {"ttft_cold_s": None, "ttft_warm_s": None, "error": "the kvd variant failed"}
    ratios = build_ratios(results)
    targets = check_targets(ratios)
    hf_cb_params = {
        "api": "model.init_continuous_batching + warmup + start + add_requests (what generate_batch runs)",
        "page_size": BLOCK_SIZE,
        "num_blocks": num_blocks,
        "max_batch_tokens": args.token_budget,
        "allow_block_sharing": True,
        "attn_implementation": (results.get("hf_continuous_batching") or {}).get("attn_implementation"),
    }
    report = {
        "benchmark": "e2e",
        "quick": args.quick,
        "machine": {
            **common.machine_info(),
            "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        },
        "code": common.source_digest(("kvd/**/*.py", "inference/**/*.py", "protos/**/*.proto", "benchmarks/e2e.py")),
        "workload": {
            **w.params,
            "model": args.model,
            "model_path": str(model_path),
            "dtype": dtype,
            "device": args.device,
            "transformers": transformers.__version__,
            "greedy": True,
            "eos": "disabled (eos_token_id=None / ignore_eos)",
            "variants": chosen,
            "block_size": BLOCK_SIZE,
            "kvd_num_blocks": num_blocks,
            "kvd_token_budget": args.token_budget,
            "kvd_max_num_seqs": args.max_num_seqs,
            "workload": "quick" if args.quick else args.workload,
            "kvd_no_cache": "engine --no-prefix-caching (every request gets a cache salt of its own)",
            "hf_continuous_batching": hf_cb_params,
            "hf_generate": "model.generate per request, in order; attention_mask all ones, min/max_new_tokens",
            "submission": "all requests at t = 0 (engines: one client thread per request, released together)",
            "timing": {
                "total_s": "t = 0 to the last request's last token (as the client received it)",
                "ttft": "t = 0 to the first new token: hf_generate: a streamer's put() right after the first "
                "token is sampled (so request i waits for 0..i-1); hf_continuous_batching: the manager's "
                "per-token timestamp (record_timestamps); engines: first streamed gRPC message with tokens",
                "warm_cold": "one request at a time on the idle kvd engine; TTFT from its submission; medians",
            },
            "warmup": "one short request per variant, not timed, sharing no prefix with the workload",
            "rounds": rounds,
            "rounds_order": "hf_generate once; then per round hf_continuous_batching, kvd_no_cache, kvd in turn "
            "(engines stay up; each round its own cache salt, so it starts cold); reported metrics are medians "
            "over rounds",
            "engines": launched,
        },
        "results": common.rounded(results),
        "ratios": common.rounded(ratios),
        "ratios_per_round": common.rounded(paired_ratios(results)),
        "targets": common.rounded(targets),
        "total_s": round(time.perf_counter() - started, 1),
    }
    common.write_json(args.json, report)
    print_report(results, ratios, targets)
    if args.plot and reference is not None:
        shown = [v for v in chosen if v not in failed]
        series = {
            "output tokens/s": [
                results[v]["output_tokens_per_s"] / results["hf_generate"]["output_tokens_per_s"] for v in shown
            ],
            "mean TTFT": [results[v]["ttft_mean_s"] / results["hf_generate"]["ttft_mean_s"] for v in shown],
        }
        if common.bar_chart(
            args.plot, shown, series, "x hf_generate", f"e2e shared-prefix workload ({args.model}, {args.device})"
        ):
            common.log(f"plot written to {args.plot}")
    common.log(f"results written to {args.json} in {report['total_s']}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
