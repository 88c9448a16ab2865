"""Seeded English-like prose for workloads, and texts cut or extended to an exact token count.

The benchmarks' prompts are real text the tokenizer sees as such, reproducible
from a seed: hand-written where it matters (e2e's report), this prose elsewhere.
"""

from __future__ import annotations

import random

#: Plain words for prompts whose text only has to tokenize as text.
WORDS = (  # noqa: SIM905 (a word list reads better as prose)
    "river harbour lock committee report spring flood bridge market grain barge toll quay tide ledger "
    "merchant warehouse canal ferry signal lantern rope anchor timber stone mill wheel gate clerk road"
).split()

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
