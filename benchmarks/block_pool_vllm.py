"""vLLM's block manager on the block-pool benchmark's workloads (a worker).

Run by a virtualenv where vLLM's ``KVCacheManager`` imports (see
/work/shared/vllm-venv or ``--vllm-python`` of ``block_pool.py``), never by
kvd's: it reads one JSON request per line on stdin and answers one JSON line
on stdout, so ``block_pool.py`` can take turns between kvd and vLLM in one run.

    {"workload": "cold", "requests": 1000, "seed": 0}   -> one pass, timed
    {"hello": true}                                      -> {"vllm": "0.33.0", ...}

A pass walks the same schedule as kvd's in-process variant: per step commit
request i-1, free request i-8, admit request i. In vLLM's terms, admitting is
building the ``Request`` (its block hashes: vLLM's default sha256 over
pickled tuples), ``get_computed_blocks`` and ``allocate_slots`` for the whole
prompt (which caches its full blocks at once); committing is what vLLM's
scheduler does after a step, moving ``num_computed_tokens``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import block_pool_workloads as wl


class VllmPool:
    """One vLLM ``KVCacheManager`` with kvd's layout and pool size."""

    def __init__(self, num_blocks: int) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        init_none_hash(sha256)
        spec = FullAttentionSpec(block_size=wl.BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16)
        # NOTE: vLLM keeps block 0 as its null block: one more makes the same usable capacity.
        config = KVCacheConfig(
            num_blocks=num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
        )
        self.manager = KVCacheManager(
            config, max_model_len=16_384, scheduler_block_size=wl.BLOCK_SIZE, hash_block_size=wl.BLOCK_SIZE
        )
        self.hasher = get_request_block_hasher(wl.BLOCK_SIZE, sha256)
        self.params = SamplingParams(max_tokens=1)

    def run(self, w: wl.Workload) -> dict[str, Any]:
        from vllm.v1.request import Request

        manager, hasher, params = self.manager, self.hasher, self.params
        n = len(w.prompts)
        op_us: dict[str, list[float]] = {op: [] for op in ("hash", "admit", "commit", "free")}
        t_hash, t_admit, t_commit, t_free = op_us.values()
        requests: list[Any] = [None] * n
        cached_tokens = new_blocks = 0
        clock = time.perf_counter_ns
        start, cpu_start = clock(), time.process_time()
        for commit, frees, admit in wl.schedule(n):
            if commit is not None:
                t0 = clock()
                requests[commit].num_computed_tokens = len(w.prompts[commit])
                t_commit.append((clock() - t0) / 1e3)
            for index in frees:
                t0 = clock()
                manager.free(requests[index])
                t_free.append((clock() - t0) / 1e3)
                requests[index] = None
            if admit is None:
                continue
            prompt = w.prompts[admit]
            t0 = clock()
            request = Request(f"r{admit}", prompt, params, None, block_hasher=hasher)
            t1 = clock()
            hits, num_hit_tokens, _ = manager.get_computed_blocks(request)
            allocated = manager.allocate_slots(request, len(prompt) - num_hit_tokens, num_hit_tokens, hits)
            t2 = clock()
            if allocated is None:
                raise RuntimeError(f"vllm {w.name}: request {admit} did not fit in {w.num_blocks} blocks")
            t_hash.append((t1 - t0) / 1e3)
            t_admit.append((t2 - t1) / 1e3)
            requests[admit] = request
            cached_tokens += num_hit_tokens
            new_blocks += len(allocated.get_block_ids()[0])
        wall_s, cpu_s = (clock() - start) / 1e9, time.process_time() - cpu_start
        free = manager.block_pool.get_num_free_blocks()
        assert free == w.num_blocks, f"vllm {w.name}: {w.num_blocks - free} blocks leaked"
        return {
            "wall_s": wall_s,
            "cpu_s": cpu_s,
            "prompt_tokens": sum(map(len, w.prompts)),
            "cached_tokens": cached_tokens,
            "new_blocks": new_blocks,
            "op_us": op_us,
        }


class VllmWorker:
    """The kvd side: this script under another python, one pass per ``run``.

    Args:
        python: a python whose environment imports vLLM's ``KVCacheManager``.
        log_path: where the worker's stderr goes.
    """

    def __init__(self, python: str, log_path: str | os.PathLike) -> None:
        env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0", "PYTHONPATH": str(Path(__file__).parent)}
        with open(log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                [python, str(Path(__file__).resolve())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env=env,
                text=True,
            )
        self.log_path = Path(log_path)
        self.info = self._ask({"hello": True})

    def run(self, name: str, num_requests: int, seed: int) -> dict[str, Any]:
        """One timed pass; the answer of ``VllmPool.run``."""
        return self._ask({"workload": name, "requests": num_requests, "seed": seed})

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the vLLM worker exited ({self.proc.wait()}):\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve(replies) -> None:
    workloads: dict[tuple[str, int, int], wl.Workload] = {}
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("hello"):
            import vllm

            answer: dict[str, Any] = {"vllm": vllm.__version__, "python": sys.version.split()[0]}
        else:
            key = (ask["workload"], ask["requests"], ask["seed"])
            if key not in workloads:
                workloads.clear()
                gc.unfreeze()
                workloads[key] = wl.build_workload(*key)
                gc.collect()
                gc.freeze()  # as in block_pool.py: collections scan the manager's objects, not the prompts
            w = workloads[key]
            pool = VllmPool(w.num_blocks)
            gc.collect()
            answer = pool.run(w)
        replies.write(json.dumps(answer) + "\n")
        replies.flush()


def main() -> int:
    # vLLM may log to stdout: answers go to the original stdout, everything else to stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(replies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
