"""CUDA graphs of the engine's forward: a step that fits a captured bucket
replays one graph instead of launching some 40 kernels a layer from Python.

A graph bakes in every address and size it was captured with, so each bucket
has fixed shapes and reads fixed (static) device buffers:

- decode buckets, batch sizes 1, 2, 4, 8, then multiples of 8 up to
  ``max_num_seqs``: ``B`` tokens, ``B`` sequences, ``B`` logit rows, one query
  each, and a split-KV count fixed per bucket, chosen for the longest
  context (the kernel cuts each sequence's positions into its ranges on the
  device, so one count is right for every length; a range past the end is
  empty and adds nothing to the merge);
- mixed buckets (prefill chunks, with or without decodes), token counts 64,
  128, ... (powers of two) and the token budget: ``T`` tokens,
  ``max_num_seqs`` sequences, ``min(T, max_num_seqs)`` logit rows, chunks of
  up to ``T`` queries, no split.

A step is padded to the first bucket it fits. Padding tokens have slot -1
(their K/V are written nowhere) and belong to no sequence; padding sequences
have no tokens and length 0 (the kernels skip them); padding logit rows
point at row 0 and are never read (a step returns its first ``n`` rows).
The padded arrays reach the static buffer in one host-to-device copy (the
block table last, and only its real rows: padding sequences read none) and
a replay writes its logits into one static output::

    | token ids T | positions T | slots T | query_start S+1 | seq_lens S | logit rows R | block table S x W |
    |<──────────────────────── one copy per step ─────────────────────────────────────────────>| n rows x W

Every bucket's views start at the buffer's first element: replays run one
after another on one stream, each after its own copy. Steps that fit no
bucket (more tokens or sequences, a sequence longer than the table's ``W``
blocks) run eagerly, as does every step of a backend other than Triton (the
torch backend plans on the host each step; flash-attn is left eager).

The cache's address is in every graph, so graphs belong to one runner: the
engine makes a new runner after each attach and captures again. Capture goes
through an injected function: on CUDA, :class:`CudaGraphCapture`
(``torch.cuda.CUDAGraph``s on one memory pool, each after an eager warm-up
that compiles the Triton kernels); in the CPU tests, :class:`EagerStandIn`,
which replays the captured callable eagerly on the same static buffers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inference.attention_metadata import AttentionMetadata, StepTensors
from inference.kernels.launch import LaunchShape, choose_splits
from inference.model_runner import ModelRunner
from inference.step_inputs import Chunk, StepInputs, step_parts

log = logging.getLogger("inference.cuda_graphs")

#: Captures a callable; returns what replays it (on the same buffers).
Capture = Callable[[Callable[[], object]], Callable[[], object]]

SMALL_DECODE_BATCHES = (1, 2, 4, 8)
DECODE_BATCH_STEP = 8
SMALLEST_MIXED_TOKENS = 64


def decode_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 8; the last is ``max_num_seqs`` itself."""
    sizes = [b for b in SMALL_DECODE_BATCHES if b < max_num_seqs]
    sizes += range(2 * DECODE_BATCH_STEP, max_num_seqs, DECODE_BATCH_STEP)
    return (*sizes, max_num_seqs)


def mixed_token_counts(token_budget: int, smallest: int = SMALLEST_MIXED_TOKENS) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below the budget, then the budget."""
    counts = []
    while smallest < token_budget:
        counts.append(smallest)
        smallest *= 2
    return (*counts, token_budget)


@dataclass(frozen=True)
class Bucket:
    """One captured graph's fixed shapes.

    Attributes:
        tokens: token rows (ids, positions, slots).
        seqs: sequence rows (``seq_lens``, block-table rows).
        logit_rows: rows of logits the graph computes.
        launch: what the attention kernels launch with.
    """

    tokens: int
    seqs: int
    logit_rows: int
    launch: LaunchShape

    def fits(self, tokens: int, seqs: int, longest_query: int) -> bool:
        return tokens <= self.tokens and seqs <= self.seqs and longest_query <= self.launch.max_query_len

    def sizes(self, width: int) -> list[int]:
        """Elements of each static view, in :func:`step_parts` order."""
        return [self.tokens] * 3 + [self.seqs + 1, self.seqs, self.logit_rows, self.seqs * width]


@dataclass(frozen=True)
class GraphPlan:
    """Which buckets a runner captures.

    Attributes:
        decode_sizes: batch sizes of the decode buckets.
        mixed_sizes: token counts of the mixed buckets.
        mixed_seqs: the sequences a mixed bucket holds (the engine's ``max_num_seqs``).
        max_context: the longest sequence a graph takes, in tokens: it sizes
            the block table and the decode split counts (0: every block of the cache).
    """

    decode_sizes: tuple[int, ...]
    mixed_sizes: tuple[int, ...]
    mixed_seqs: int
    max_context: int = 0

    @classmethod
    def for_engine(cls, max_num_seqs: int, token_budget: int, max_context: int) -> GraphPlan:
        return cls(decode_batch_sizes(max_num_seqs), mixed_token_counts(token_budget), max_num_seqs, max_context)

    def buckets(self, decode_splits: Callable[[int], int]) -> list[Bucket]:
        """Decode buckets, then mixed ones, each kind smallest first (the order a step tries them)."""
        decode = [Bucket(b, b, b, LaunchShape(b, 1, decode_splits(b))) for b in sorted(set(self.decode_sizes))]
        s = self.mixed_seqs
        mixed = [Bucket(t, s, min(t, s), LaunchShape(s, t)) for t in sorted(set(self.mixed_sizes))]
        return decode + mixed


class StepGraphs:
    """One runner's captured buckets, the static buffer they read and the
    static logits they write.

    Args:
        runner: its model, cache and host staging.
        plan: the buckets to capture.
        capture: :class:`CudaGraphCapture` on CUDA, :class:`EagerStandIn` elsewhere.
    """

    def __init__(self, runner: ModelRunner, plan: GraphPlan, capture: Capture) -> None:
        # NOTE: weak: the runner holds these graphs, and nothing here may hold
        # it back, so dropping a runner (a lost daemon) frees its cache
        # mapping and the graphs' memory at once, not at the next GC.
        self.runner = weakref.proxy(runner)
        self._capture = capture
        num_blocks, kv_heads = runner.kv_cache.shape[0], runner.kv_cache.shape[4]
        max_blocks = -(-plan.max_context // runner.block_size) if plan.max_context else num_blocks
        self.width = min(num_blocks, max_blocks)  # block-table columns: the longest sequence's blocks
        self.longest = longest = self.width * runner.block_size  # positions a graphed sequence may reach

        def decode_splits(seqs: int) -> int:
            return choose_splits(seqs, 1, longest, kv_heads, runner.num_sms) if runner.num_sms else 1

        self.buckets = plan.buckets(decode_splits)
        size = max(sum(bucket.sizes(self.width)) for bucket in self.buckets)
        self._static = torch.zeros(size, dtype=torch.int32, device=runner.device)
        self._replays: dict[Bucket, Callable[[], object]] = {}
        self.logits: torch.Tensor | None = None  # [most logit rows, vocab], every graph's output
        self.replays = 0  # steps that replayed a graph
        self.capture_s = 0.0
        self.capture_bytes = 0  # device memory the graphs hold (CUDA)

    def bucket_for(self, chunks: Sequence[Chunk]) -> Bucket | None:
        """The first bucket the step fits (None: it runs eagerly)."""
        tokens = longest_query = longest_seq = 0
        for chunk in chunks:
            if chunk.num_prompt_logits:
                return None  # a bucket's logits are one row per sequence
            queries = len(chunk.token_ids)
            tokens += queries
            longest_query = max(longest_query, queries)
            longest_seq = max(longest_seq, chunk.first + queries)
        if longest_seq > self.longest:
            return None
        return next((b for b in self.buckets if b.fits(tokens, len(chunks), longest_query)), None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warms up and captures every bucket, the largest first (later,
        smaller graphs reuse its pool memory)."""
        device = self.runner.device
        on_cuda = device.type == "cuda"
        if on_cuda:
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved(device)
        started = time.perf_counter()
        for bucket in sorted(self.buckets, key=lambda b: (b.tokens, b.seqs), reverse=True):
            self._capture_bucket(bucket)
        if on_cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # what stays reserved is the graphs' pool
            self.capture_bytes = torch.cuda.memory_reserved(device) - reserved
        self.capture_s = time.perf_counter() - started

    def _capture_bucket(self, bucket: Bucket) -> None:
        ids, positions, slots, query_start, seq_lens, logit_rows, table = self._views(bucket)
        # Warm-up and capture read inputs that are all padding: no slot is
        # written, no sequence has a position (the cache is never touched).
        self._static.zero_()
        slots.fill_(-1)
        step = StepTensors(slots, query_start, seq_lens, table, bucket.launch)
        meta = AttentionMetadata(self.runner.kv_cache, step, [], [])  # the Triton backend reads only these
        runner = self.runner  # not self: the closures must not hold these graphs (a cycle)

        def run() -> torch.Tensor:
            return runner.run_model(ids, positions, meta, logit_rows)

        warm = run()  # outside the capture: Triton compiles, cuBLAS settles its kernels
        if self.logits is None:
            rows = max(b.logit_rows for b in self.buckets)
            self.logits = torch.empty(rows, warm.shape[1], dtype=warm.dtype, device=warm.device)
        out = self.logits[: bucket.logit_rows]
        self._replays[bucket] = self._capture(lambda: out.copy_(run()))

    def _views(self, bucket: Bucket) -> list[torch.Tensor]:
        sizes = bucket.sizes(self.width)
        views = list(self._static[: sum(sizes)].split(sizes))
        views[-1] = views[-1].view(bucket.seqs, self.width)
        return views

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk]) -> torch.Tensor | None:
        """Replays the step's bucket: its logits ``[n, vocab]``, a view of the
        static output (None: the step fits no bucket; run it eagerly).

        NOTE: one copy into the static buffer, then the replay, both queued
        on the current stream after the previous step's work: the previous
        replay has read its inputs before this copy lands. The returned view
        is overwritten by the next replay, so its reader (the engine's
        sampler) must be enqueued before the next forward.
        """
        bucket = self.bucket_for(chunks)
        if bucket is None:
            return None
        inputs, wanted = self._padded_inputs(chunks, bucket)
        table = np.zeros((inputs.num_seqs, self.width), np.int32)  # real rows only
        table[:, : inputs.block_table.shape[1]] = inputs.block_table[: inputs.num_seqs]
        host = self.runner.staging.pack(step_parts(inputs, table))
        self._static[: host.numel()].copy_(host, non_blocking=True)
        self._replays[bucket]()
        self.replays += 1
        return self.logits[:wanted]

    @torch.inference_mode()
    def eager(self, chunks: Sequence[Chunk]) -> torch.Tensor | None:
        """The same step run eagerly on fresh device tensors: the same padded
        inputs and launch shapes a replay runs (the bitwise reference of a
        graph: another row count could make cuBLAS pick other kernels)."""
        bucket = self.bucket_for(chunks)
        if bucket is None:
            return None
        inputs, wanted = self._padded_inputs(chunks, bucket)
        ids, positions, logit_rows, step = self.runner.staging.to_device(inputs, bucket.launch)
        meta = AttentionMetadata(self.runner.kv_cache, step, [], [])
        return self.runner.run_model(ids, positions, meta, logit_rows)[:wanted]

    def _padded_inputs(self, chunks: Sequence[Chunk], bucket: Bucket) -> tuple[StepInputs, int]:
        """The step's arrays padded to the bucket; how many logit rows are real."""
        inputs = self.runner.step_inputs(chunks, pad_tokens=bucket.tokens, pad_seqs=bucket.seqs)
        wanted = len(inputs.logit_rows)
        rows = np.zeros(bucket.logit_rows, np.int32)  # padding rows compute row 0's logits, never read
        rows[:wanted] = inputs.logit_rows
        return dataclasses.replace(inputs, logit_rows=rows), wanted


def capture_graphs(runner: ModelRunner, plan: GraphPlan, capture: Capture) -> StepGraphs | None:
    """Captures the plan's buckets on the runner's cache (after each attach).

    Returns:
        The graphs, or None where every step runs eagerly: a backend other
        than Triton, or a capture that failed (logged; a model whose forward
        does something a graph cannot hold still serves, eagerly).
    """
    if runner.backend != "triton":
        log.info("CUDA graphs off: only the triton backend is graphed", extra={"backend": runner.backend})
        return None
    graphs = StepGraphs(runner, plan, capture)
    try:
        graphs.capture()
    except Exception:
        log.exception("CUDA graph capture failed; every step runs eagerly")
        return None
    log.info(
        "captured CUDA graphs",
        extra={"graphs": len(graphs.buckets), "capture_s": round(graphs.capture_s, 3),
               "capture_mib": round(graphs.capture_bytes / 2**20, 1), "table_width": graphs.width,
               "decode_batches": [b.seqs for b in graphs.buckets if b.launch.max_query_len == 1],
               "mixed_tokens": [b.tokens for b in graphs.buckets if b.launch.max_query_len > 1]},
    )  # fmt: skip
    return graphs


class CudaGraphCapture:
    """Captures with ``torch.cuda.graph`` on one memory pool shared by all of
    a runner's graphs (safe: replays never overlap, they run in turn on one
    stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, run: Callable[[], object]) -> Callable[[], object]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's threads may touch CUDA meanwhile (not into this capture).
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            run()
        return graph.replay


class EagerStandIn:
    """Stands in for graph capture where there is no CUDA (the CPU tests):
    records each captured callable, and a replay calls it again, reading the
    same static buffers and writing the same static output a graph would."""

    def __init__(self) -> None:
        self.captured: list[Callable[[], object]] = []
        self.replays = 0

    def __call__(self, run: Callable[[], object]) -> Callable[[], object]:
        self.captured.append(run)

        def replay() -> object:
            self.replays += 1
            return run()

        return replay
