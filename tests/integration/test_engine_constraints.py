"""Structured outputs through a real engine (SmolLM2, float32): every
constrained output matches its constraint, sampled at temperature 1 too;
greedy output is the unconstrained one wherever that already matches; rows
without a constraint are untouched beside constrained ones; a constraint
that does not compile is INVALID_ARGUMENT naming it."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from kvd_api.engine.v1 import engine_pb2 as pb
from tests.integration.engine_client import generate, stub

#: Nesting, enums, arrays, additionalProperties false, bounded numbers.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "height_m", "role", "tags", "address"],
    "additionalProperties": False,
}
QUESTIONS = [
    "Describe a fictional person as JSON.",
    "Give me a JSON record for a new employee called Ana.",
    "Who is the admin of the chess club? Answer in JSON.",
    "Invent a user of a small web shop.",
    "Make up a guest at a hotel in Lyon.",
    "Write a profile of a retired teacher.",
]


@pytest.fixture(scope="module")
def engine(shared_stack):
    return stub(shared_stack.address)


def chat(question: str, max_new_tokens: int, constraint: pb.Constraint | None = None, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content=question)]),
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, constraint=constraint, **sampling),
    )


def run_all(engine, requests: list[pb.GenerateRequest]) -> list[tuple[list[int], str, pb.GenerateResponse]]:
    """All at once: their rows share the engine's batches."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: generate(engine, r), requests))


def test_json_schema_outputs_validate_greedy_and_sampled_at_temperature_1(engine):
    constraint = pb.Constraint(json_schema=json.dumps(PERSON))
    requests = [chat(q, 300, constraint) for q in QUESTIONS]
    requests += [chat(q, 300, constraint, temperature=1.0, seed=seed) for seed, q in enumerate(QUESTIONS)]
    for _, text, final in run_all(engine, requests):
        assert final.finish_reason == pb.FINISH_REASON_EOS, text  # the grammar ended it, not the length
        jsonschema.validate(json.loads(text), PERSON)


def test_regex_and_choice_outputs_match_sampled_at_temperature_1(engine):
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    options = ["red", "green", "blue", "light yellow"]
    regex_requests = [chat(q, 40, pb.Constraint(regex=date), temperature=1.0, seed=i) for i, q in enumerate(QUESTIONS)]
    choice_requests = [
        chat(q, 40, pb.Constraint(choice=pb.Choices(options=options)), temperature=1.0, seed=i)
        for i, q in enumerate(QUESTIONS)
    ]
    results = run_all(engine, regex_requests + choice_requests)
    for _, text, _ in results[: len(regex_requests)]:
        assert re.fullmatch(date, text), text
    for _, text, _ in results[len(regex_requests) :]:
        assert text in options


def test_json_object_and_grammar_outputs_match(engine):
    obj = pb.Constraint(json_object=True)
    grammar = pb.Constraint(grammar='root ::= "(" [a-z]+ ("," [a-z]+)* ")"')
    # NOTE: the chess club's question: on the others the small model repeats a key until the length ends it.
    results = run_all(engine, [chat(QUESTIONS[2], 200, obj), chat(QUESTIONS[1], 60, grammar, temperature=1.0, seed=3)])
    assert results[0][2].finish_reason == pb.FINISH_REASON_EOS, results[0][1]
    assert isinstance(json.loads(results[0][1]), dict)
    assert re.fullmatch(r"\([a-z]+(,[a-z]+)*\)", results[1][1]), results[1][1]


def test_greedy_output_is_unchanged_where_it_already_matches(engine):
    """A constraint its unconstrained greedy output satisfies (a choice with
    it among decoys, a regex accepting it) changes no token."""
    for question in ("What is the capital of France? Answer in one word.", "Name three colours, comma-separated."):
        tokens, text, final = generate(engine, chat(question, 60))
        assert final.finish_reason == pb.FINISH_REASON_EOS and text
        decoys = pb.Choices(options=[text[:3] + "zzz", text, "no"])
        as_choice = generate(engine, chat(question, 60, pb.Constraint(choice=decoys)))
        as_regex = generate(engine, chat(question, 60, pb.Constraint(regex=r"[\s\S]{1,400}")))
        assert as_choice[0] == tokens and as_regex[0] == tokens


def test_unconstrained_rows_are_untouched_beside_constrained_ones(engine):
    plain = chat(QUESTIONS[2], 24)
    alone = generate(engine, plain)[0]
    constrained = [chat(q, 24, pb.Constraint(json_schema=json.dumps(PERSON))) for q in QUESTIONS[:3]]
    beside = run_all(engine, [plain, *constrained])[0][0]
    assert beside == alone


@pytest.mark.parametrize(
    ("constraint", "reason"),
    [
        (pb.Constraint(json_schema='{"type": "strin"}'), 'Unsupported type "strin"'),
        (pb.Constraint(json_schema="{not json"), "json_schema"),
        (pb.Constraint(json_schema="[1, 2]"), "a JSON schema is a JSON object"),
        (pb.Constraint(regex="(?<=a)b"), "Lookbehind"),
        (pb.Constraint(grammar="root ::= undefined_rule"), "is not defined"),
        (pb.Constraint(choice=pb.Choices()), "one or more options"),
        (pb.Constraint(regex="  "), "empty"),
        (pb.Constraint(json_object=False), "set it to true"),
    ],
)
def test_a_constraint_that_does_not_compile_is_invalid_argument_naming_it(engine, constraint, reason):
    with pytest.raises(grpc.RpcError) as err:
        generate(engine, chat("Hi", 8, constraint))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.constraint" in err.value.details() and reason in err.value.details()
    metadata = dict(err.value.trailing_metadata() or ())
    assert metadata.get("kvd-field") == "sampling.constraint"


def test_the_engine_keeps_one_openmp_pool(shared_stack, engine):
    """Every parallel op of the process runs on the engine loop's OpenMP pool:
    a second pool (the model loaded on another lasting thread, a constraint
    compiled on an RPC thread) cuts every worker's spin short, and each
    forward's workers then sleep hundreds of times (inference/openmp.py)."""
    import torch

    from tests.openmp_pools import settled_idle_workers

    if torch.get_num_threads() < 2:
        pytest.skip("one OpenMP thread: no pool to count")
    prompt = list(range(1000, 1300))  # long enough for parallel ops in the prefill
    run_all(engine, [
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                           sampling=pb.SamplingParams(max_new_tokens=8, logprobs=True, top_logprobs=5,
                                                      prompt_logprobs=True)),
        chat(QUESTIONS[0], 30, pb.Constraint(json_schema=json.dumps(PERSON))),
        chat(QUESTIONS[1], 8, pb.Constraint(regex="[a-z]+")),
    ])  # fmt: skip
    assert settled_idle_workers(shared_stack.process.pid) == torch.get_num_threads() - 1
