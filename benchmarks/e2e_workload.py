"""e2e.py's workload: one shared report, a question per request, and what a pass over it measures.

The text is real and hand-written (a ~640-token report, sixteen questions on
it) so the tokenizer and the model see what they would in use; the warm/cold
prefixes are seeded prose (``harness.text``). ``Run`` is one variant's pass:
per request its time to first token, tokens and cached tokens;
``combine_rounds`` takes each metric's median over the rounds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import harness
from harness.text import english_like, exact_tokens

#: The headline metrics of a pass (medians over rounds in the JSON).
METRICS = ("total_s", "output_tokens_per_s", "ttft_mean_s", "ttft_p90_s", "cached_token_ratio")
BLOCK_SIZE = 16

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
            "ttft_mean_s": harness.mean(self.ttft_s),
            "ttft_p90_s": harness.percentile(self.ttft_s, 90),
            "cached_token_ratio": sum(self.cached_tokens) / sum(self.prompt_tokens),
            "ttft_p50_s": harness.median(self.ttft_s),
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
    combined = {**middle, **{m: harness.median([s[m] for s in summaries]) for m in METRICS}}
    combined["rounds"] = [{m: s[m] for m in METRICS} for s in summaries]
    return combined
