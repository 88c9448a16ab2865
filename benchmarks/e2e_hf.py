"""e2e.py's two transformers baselines: ``model.generate`` one request at a time, and
transformers' own continuous batching (paged cache, prefix sharing on), in this process."""

from __future__ import annotations

import time
from typing import Any

import harness
import torch
from e2e_workload import BLOCK_SIZE, Run, Workload
from harness.streams import RPC_TIMEOUT_S

from kvd.common.defaults import TOKEN_BUDGET


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
    progress = harness.Progress("hf_generate", len(w.prompts))
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
    """Paged, sharing blocks, ``token_budget`` tokens per forward as the engine's.

    NOTE: transformers' default max_batch_tokens, 8192, puts every prompt in
    one forward whose attention mask is quadratic in it: 8 x 640-token prompts
    took 36.6 s instead of 5.7-7.9 s on this machine (256: 7.7 s, 1024: 10.1 s).
    """
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
        progress = harness.Progress("hf_continuous_batching", len(w.prompts))
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


def _cb_collect(manager, ids: list[str], timeout_s: float, progress: harness.Progress | None = None) -> dict[str, Any]:
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
