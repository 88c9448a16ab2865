"""Two real engines of the same model on one daemon: shared cache, separate fates.

(The same with a fake model, under preemption and for fairness between
sessions: tests/integration/test_step_pipeline.py.)
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from tests.conftest import blocks_held, start_daemon, start_engine, wait_for
from tests.integration.engine_client import generate, request, stub
from tests.model_families import FAMILIES, build

DOC = list(range(2000, 2080))  # 80 tokens: 5 full blocks of 16
LONG = list(range(3000, 3100))


def test_two_engines_hit_each_others_prompts_and_one_death_spares_the_other(workdir, model_dir):
    daemon = start_daemon(["--block-size", "16", "--num-blocks", "256", "--lease-s", "1"], workdir)
    args = ["--model", str(model_dir), "--dtype", "float64"]
    first, second = start_engine(daemon, args, workdir), start_engine(daemon, args, workdir)
    try:
        one, two = stub(first.address), stub(second.address)
        tokens_one, _, last = generate(one, request(DOC + [5, 6, 7], 6))
        assert last.usage.cached_prompt_tokens == 0
        # The second engine finds the first one's blocks, and computes the same tokens.
        tokens_two, _, last = generate(two, request(DOC + [5, 6, 7], 6))
        assert last.usage.cached_prompt_tokens == 80 and tokens_two == tokens_one
        _, _, last = generate(one, request(DOC + [9], 4))
        assert last.usage.cached_prompt_tokens == 80

        # The first engine dies (SIGKILL) while both generate.
        expected, _, _ = generate(two, request(LONG, 24))
        results: dict[str, list[int]] = {}
        survivor = threading.Thread(target=lambda: results.setdefault("two", generate(two, request(LONG, 24))[0]))
        doomed_stream = one.Generate(request(LONG[::-1], 400))
        next(doomed_stream)
        survivor.start()
        first.stop(signal.SIGKILL)
        survivor.join(120)
        assert results.get("two") == expected
        # The daemon releases the dead engine's blocks when its lease lapses.
        assert wait_for(lambda: blocks_held(daemon) == 0, 15)
    finally:
        first.stop(signal.SIGKILL)
        second.stop()
        daemon.stop()


def test_an_engine_of_another_model_or_layout_is_refused_naming_the_difference(workdir):
    """Same layers, heads and dtype, other weights: its blocks would hold
    other numbers under the same hashes. It must not attach, and it says why."""
    base, tuned, other = Path(workdir) / "base", Path(workdir) / "tuned", Path(workdir) / "other"
    build(FAMILIES["llama"], base, seed=0)
    build(FAMILIES["llama"], tuned, seed=1)
    build(FAMILIES["qwen3"], other)  # another layout too (head dim 128)
    daemon = start_daemon(["--block-size", "16", "--num-blocks", "64"], workdir)
    first = start_engine(daemon, ["--model", str(base), "--dtype", "float32"], workdir)
    refused = [
        start_engine(daemon, ["--model", str(model), "--dtype", "float32"], workdir, wait=False)
        for model in (tuned, other)
    ]
    try:
        for engine, why in zip(refused, ("weights digest", "does not match the daemon's cache"), strict=True):
            assert engine.process.wait(timeout=120) == 2
            log = engine.log()
            assert "refused this engine" in log and why in log, log
        generate(stub(first.address), request([5, 6, 7, 8], 2))  # the first one serves on
    finally:
        for engine in refused:
            engine.stop()
        first.stop()
        daemon.stop()
