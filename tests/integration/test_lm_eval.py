"""EleutherAI's lm-evaluation-harness against the gateway's HTTP API, called as
its users call it: ``local-completions`` scoring a multiple-choice task (token-id
prompts with ``echo``, ``logprobs: 1`` and ``max_tokens: 1``, several prompts a
request) and ``local-chat-completions`` answering short questions through the
chat template. Each run is compared with lm-eval's own ``hf`` model on the same
model folder in float32: the per-choice loglikelihoods, greedy flags and
accuracy, and the generated texts. A benchmark number that moves when a user
switches from ``hf`` to the server is a bug in the server.

One stack for the module: a daemon, a float32 engine on the real SmolLM2 and a
gateway without API keys. The tasks are local JSON-lines files and the model is a
local folder; a guard refuses any connection from the test process that does not
stay on 127.0.0.1, so lm-eval, datasets and transformers cannot reach the hub.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.conftest import http_stack

# Within float32 rounding of a 135M model over a dozen tokens; a wrong position or
# a missed token is off by whole nats.
LOGLIKELIHOOD_TOLERANCE = 2e-3
MC_TASK = "kvd_facts_mc"
GEN_TASK = "kvd_short_answers"

# (question, choices, index of the answer); the choices follow lm-eval's default
# target delimiter, a space. The model's greedy answer to the numeric questions is
# the right choice, so some of the greedy flags compared are true.
FACTS = [
    ("What color is the sky on a clear day?", ["blue", "green", "red", "yellow"], 0),
    ("How many legs does a dog have?", ["2", "4", "6", "8"], 1),
    ("What is the capital of France?", ["Berlin", "Madrid", "Paris", "Rome"], 2),
    ("Which animal says moo?", ["cat", "dog", "duck", "cow"], 3),
    ("What do bees make?", ["honey", "milk", "silk", "wool"], 0),
    ("What is frozen water called?", ["steam", "ice", "sand", "glass"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Jupiter"], 2),
    ("How many days are in a week?", ["5", "6", "10", "7"], 3),
    ("How many wheels does a bicycle have?", ["1", "2", "3", "4"], 1),
    ("Which meal is eaten in the morning?", ["dinner", "breakfast", "supper", "lunch"], 1),
]
# The model's greedy answers end by its end of turn, by the stop string "\n" (the
# list and the haiku) and by max_gen_toks (photosynthesis), so that each way a
# generation ends is compared.
QUESTIONS = [
    ("What is the capital of France? Answer in one word.", "Paris"),
    ("List three fruits, one per line.", "1. Apple"),
    ("Write a haiku about the sea.", "Waves"),
    ("What is photosynthesis?", "A process"),
]


@pytest.fixture(scope="module")
def offline():
    """lm-eval in this process, with every connection and name lookup refused that leaves 127.0.0.1."""
    connect, connect_ex, getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo
    # Kept as well as refused: a library may swallow the error and fall back.
    refused = []

    def check(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not ipaddress.ip_address(address[0]).is_loopback:
            refused.append(address)
            raise ConnectionRefusedError(f"the test refuses a connection off 127.0.0.1: {address}")

    def guarded_getaddrinfo(host, *args, **kwargs):
        # A lookup of a name asks a resolver off the machine; a numeric address asks none.
        if host not in (None, "localhost") and not is_address(host):
            refused.append(host)
            raise socket.gaierror(socket.EAI_NONAME, f"the test refuses to look up {host}")
        return getaddrinfo(host, *args, **kwargs)

    def guarded_connect(sock, address):
        check(sock, address)
        return connect(sock, address)

    def guarded_connect_ex(sock, address):
        check(sock, address)
        return connect_ex(sock, address)

    with pytest.MonkeyPatch.context() as patch:
        # The hub libraries read these when first imported, so before lm_eval is.
        for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(variable, "1")
        # The gateway checks no keys; lm-eval's local models then send an empty bearer.
        patch.delenv("OPENAI_API_KEY", raising=False)
        patch.setattr(socket.socket, "connect", guarded_connect)
        patch.setattr(socket.socket, "connect_ex", guarded_connect_ex)
        patch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
        import datasets.config
        import huggingface_hub.constants
        import lm_eval
        import lm_eval.tasks

        # Set as well, in case another module imported the hub libraries first.
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        yield lm_eval
    assert not refused, f"connections off 127.0.0.1 tried: {refused}"


def is_address(host) -> bool:
    try:
        ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def stack(model_dir):
    """The HTTP API's base URL, once the gateway serves."""
    daemon = ["--block-size", "16", "--num-blocks", "256", "--lease-s", "2"]
    with http_stack(model_dir, daemon, ["--dtype", "float32"]) as stack:
        yield stack.base_url


@pytest.fixture(scope="module")
def served_name(stack):
    """The name ``/v1/models`` lists: what a user copies into ``model=``."""
    return httpx.get(f"{stack}/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def task_manager(offline, tmp_path_factory):
    """lm-eval's task manager over the two local tasks."""
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    facts = folder / "facts.jsonl"
    facts.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in FACTS))
    questions = folder / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    # JSON is YAML: no quoting of the newlines and braces in the templates.
    write_task(
        folder / f"{MC_TASK}.yaml",
        facts,
        task=MC_TASK,
        output_type="multiple_choice",
        doc_to_text="Question: {{question}}\nAnswer:",
        doc_to_choice="choices",
        doc_to_target="answer",
        metric_list=[{"metric": "acc"}],
    )
    write_task(
        folder / f"{GEN_TASK}.yaml",
        questions,
        task=GEN_TASK,
        output_type="generate_until",
        doc_to_text="{{question}}",
        doc_to_target="answer",
        generation_kwargs={"until": ["\n"], "max_gen_toks": 16, "do_sample": False, "temperature": 0},
        metric_list=[{"metric": "exact_match"}],
    )
    return offline.tasks.TaskManager(include_path=str(folder))


def write_task(path: Path, data: Path, **fields) -> None:
    # The datasets cache beside the data, so that runs leave nothing in ~/.cache.
    dataset = {"data_files": {"test": str(data)}, "cache_dir": str(data.parent / "datasets")}
    config = {"dataset_path": "json", "dataset_kwargs": dataset, "test_split": "test", **fields}
    path.write_text(json.dumps(config, indent=2))


def evaluate(lm_eval, task_manager, task: str, model: str, model_args: str, **options) -> tuple[float, list[dict]]:
    """The task's headline metric and its samples in document order."""
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=task_manager,
        log_samples=True,
        bootstrap_iters=0,
        **options,
    )
    metrics = results["results"][task]
    metric = "acc,none" if "acc,none" in metrics else "exact_match,none"
    return metrics[metric], sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def hf_args(model_dir) -> str:
    return f"pretrained={model_dir},dtype=float32,device=cpu,batch_size=1"


def test_lm_eval_local_completions_loglikelihoods_agree_with_its_hf_model(
    offline, task_manager, stack, served_name, model_dir
):
    # batch_size=4: four prompts a request, of different lengths (lm-eval sorts them by
    # length), those of one question sharing its context, which the gateway scores once.
    api_args = (
        f"model={served_name},base_url={stack}/completions,tokenizer_backend=huggingface,"
        f"tokenizer={model_dir},batch_size=4,num_concurrent=1,max_retries=1"
    )
    api_acc, api_samples = evaluate(offline, task_manager, MC_TASK, "local-completions", api_args)
    hf_acc, hf_samples = evaluate(offline, task_manager, MC_TASK, "hf", hf_args(model_dir))

    api = [[tuple(r) for r in s["filtered_resps"]] for s in api_samples]
    hf = [[tuple(r) for r in s["filtered_resps"]] for s in hf_samples]
    assert [len(choices) for choices in api] == [len(choices) for choices in hf] == [4] * len(FACTS)
    differences = [
        abs(a[0] - h[0])
        for api_choices, hf_choices in zip(api, hf, strict=True)
        for a, h in zip(api_choices, hf_choices, strict=True)
    ]
    greedy = sum(flag for choices in hf for _, flag in choices)
    print(
        f"max |loglikelihood difference| {max(differences):.2e}; acc {api_acc} (server) {hf_acc} (hf); {greedy} greedy"
    )
    assert max(differences) <= LOGLIKELIHOOD_TOLERANCE, (api, hf)
    hf_greedy = [[h[1] for h in choices] for choices in hf]
    assert any(any(flags) for flags in hf_greedy), "no choice is the greedy continuation: the flags compare nothing"
    assert [[a[1] for a in choices] for choices in api] == hf_greedy
    assert api_acc == hf_acc


def test_lm_eval_local_chat_completions_answers_as_its_hf_model_does(
    offline, task_manager, stack, served_name, model_dir
):
    api_args = f"model={served_name},base_url={stack}/chat/completions,num_concurrent=1,max_retries=1"
    api_score, api_samples = evaluate(
        offline, task_manager, GEN_TASK, "local-chat-completions", api_args, apply_chat_template=True
    )
    hf_score, hf_samples = evaluate(offline, task_manager, GEN_TASK, "hf", hf_args(model_dir), apply_chat_template=True)

    api = [s["filtered_resps"][0] for s in api_samples]
    hf = [s["filtered_resps"][0] for s in hf_samples]
    print(f"answers {api!r} (server) {hf!r} (hf); exact_match {api_score} (server) {hf_score} (hf)")
    assert api == hf
    assert api_score == hf_score
