"""One generation request as the engine tracks it."""

from __future__ import annotations

import enum
import queue
import time
from dataclasses import dataclass, field

import torch

from inference.sampling import SamplingParams


class Finish(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"
    ERROR = "error"  # the engine lost the daemon or failed; see Sequence.error


@dataclass(eq=False)
class Sequence:
    """A request: its tokens, its block table, its output.

    The daemon owns its schedule (waiting, running, preempted); the engine
    keeps what it needs to run the chunks the daemon hands out.

    Attributes:
        request_id: unique within the engine; also the daemon's request id.
        prompt_ids: the prompt's tokens.
        output_ids: sampled tokens so far.
        block_table: the daemon's block ids for this sequence, in order, as
            its Step replies gave them (empty while it waits).
        priority: smaller runs first (the daemon orders by it, then arrival).
        num_cached_prompt: prompt tokens served from the cache at admission.
        prefill_only: a warm-up: stop once the prompt is in the cache.
        events: what the gRPC handler streams out: (token ids, logprobs) tuples,
            then a final ``None``.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: bytes = b""
    prefill_only: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    priority: int = 0
    finish: Finish | None = None
    error: str = ""
    block_table: list[int] = field(default_factory=list)
    num_cached_prompt: int = -1  # -1 until first admitted
    num_host_cached_prompt: int = 0  # of num_cached_prompt, copied back from the host tier
    #: while waiting: the prompt tokens its daemon held when it came (load reports; 0: not asked)
    expected_cached: int = 0
    num_computed: int = 0  # tokens whose K/V a finished forward wrote (load reports)
    generator: torch.Generator | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish is not None
