"""Constraints compiled against the real tokenizer, and their masks: the
mask equals xgrammar's own (its ``apply_token_bitmask_inplace``), touches
only constrained rows, keeps the greedy token wherever the grammar allows
it, and a constraint that does not compile names why."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

import jsonschema
import pytest
import torch
import xgrammar

from inference.constraints import Constraint, GrammarCompiler, GrammarState, mask_logits, new_bitmask
from inference.sampling import BatchedSampler, Sampler, SamplingParams, make_generator
from kvd.common.field_error import FieldError
from kvd_api.engine.v1 import engine_pb2 as pb

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
EOS = 2


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [EOS])


def state(compiler, **kind):
    return compiler.state(Constraint.from_pb(pb.Constraint(**kind)))


def test_the_mask_equals_xgrammars_and_leaves_other_rows_alone(compiler, tokenizer):
    states = [None, state(compiler, json_schema=json.dumps(SCHEMA)), None, state(compiler, regex=r"[0-9]+ apples")]
    logits = torch.randn(4, len(tokenizer), generator=torch.Generator().manual_seed(0))
    ours = logits.clone()
    mask_logits(ours, states)
    bitmask = new_bitmask(4, len(tokenizer))
    for row, s in enumerate(states):
        if s is not None:
            s.fill(bitmask, row)
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[0], logits[0]) and torch.equal(ours[2], logits[2])
    assert 0 < torch.isfinite(ours[1]).sum() < 100 and 0 < torch.isfinite(ours[3]).sum() < 100


def test_a_grammar_that_allows_the_greedy_token_keeps_it(compiler, tokenizer):
    """Walking a text the grammar accepts, with that text's next token made
    the most likely each step: the masked argmax is always it."""
    text = '{"n": 42}'
    ids = tokenizer.encode(text, add_special_tokens=False) + [EOS]
    s = state(compiler, json_schema=json.dumps(SCHEMA))
    for token in ids:
        logits = torch.randn(1, len(tokenizer))
        logits[0, token] = logits.max() + 1
        mask_logits(logits, [s])
        assert int(logits.argmax()) == token
        assert s.accept(token)
    assert s.finished


def test_a_finished_grammar_allows_only_the_end_of_sequence(compiler, tokenizer):
    s = state(compiler, choice=pb.Choices(options=["yes", "no"]))
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert s.accept(token)
    logits = torch.zeros(1, len(tokenizer))
    mask_logits(logits, [s])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]


def test_a_token_the_grammar_forbids_is_not_accepted(compiler, tokenizer):
    s = state(compiler, regex="[0-9]+")
    assert not s.accept(tokenizer.encode("abc", add_special_tokens=False)[0])


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ({"json_schema": '{"type": "strin"}'}, 'constraint.json_schema: Unsupported type "strin"'),
        ({"json_schema": "true"}, "a JSON schema is a JSON object"),
        ({"regex": "(?<=a)b"}, "Lookbehind"),
        ({"grammar": "root ::= nothing"}, 'Rule "nothing" is not defined'),
        ({"choice": pb.Choices(options=["a", ""])}, "none of them empty"),
        ({"grammar": ""}, "constraint.grammar is empty"),
    ],
)
def test_a_constraint_that_does_not_compile_names_why(compiler, kind, reason):
    with pytest.raises(FieldError, match=reason) as err:
        state(compiler, **kind)
    assert err.value.field == "constraint"
    assert "/project/" not in str(err.value)  # xgrammar's source location is left out


def test_no_constraint_is_none_and_the_same_text_is_the_same_key():
    assert Constraint.from_pb(pb.Constraint()) is None
    a = Constraint.from_pb(pb.Constraint(regex="a+"))
    assert a == Constraint.from_pb(pb.Constraint(regex="a+")) and hash(a) == hash(Constraint("regex", "a+"))


@dataclass
class Row:
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None


@pytest.mark.parametrize("sampler", [Sampler({EOS}), BatchedSampler({EOS})], ids=["row", "batched"])
def test_both_samplers_draw_only_what_each_rows_grammar_allows(compiler, tokenizer, sampler):
    """The batched sampler (the GPU's, device-agnostic) and the row sampler
    (the CPU's), greedy and at temperature 1, beside an unconstrained row:
    a whole date drawn token by token matches its regex."""
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
    rows = [Row(grammar=state(compiler, regex=date)), Row(), Row(grammar=state(compiler, regex=date))]
    params = [SamplingParams(temperature=1.0, seed=1, constraint=Constraint("regex", date)), SamplingParams(),
              SamplingParams(constraint=Constraint("regex", date))]  # fmt: skip
    generators = [make_generator(p.seed) for p in params]
    logits_rng = torch.Generator().manual_seed(3)
    while not all(r.grammar.finished for r in rows if r.grammar is not None):
        sampled = sampler.sample(torch.randn(3, len(tokenizer), generator=logits_rng), params, generators, rows)
        for row, token in zip(rows, sampled.tokens, strict=True):
            if row.grammar is not None and not row.grammar.finished:
                assert row.grammar.accept(token)
                row.output_ids.append(token)
    for row in (rows[0], rows[2]):
        assert row.output_ids[-1] == EOS and re.fullmatch(date, tokenizer.decode(row.output_ids[:-1]))


#: Features the grammar enforces: random walks through their grammars end in documents that validate.
ENFORCED = {
    "nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"enum": [1, "x"]}},
               "required": ["b"], "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    "bounded": {"type": "array", "items": {"type": "number", "minimum": 0.5, "maximum": 2.5}, "minItems": 1,
                "maxItems": 3},
    "integer": {"type": "integer", "exclusiveMinimum": 0, "maximum": 3, "multipleOf": 1},
    "pattern": {"type": "string", "pattern": "^[a-c]{2}$"},
    "one_allOf_and_refs": {"$defs": {"A": {"type": "integer", "minimum": 3, "maximum": 5}}, "type": "object",
                           "properties": {"a": {"allOf": [{"$ref": "#/$defs/A"}]}, "b": {"$ref": "#/$defs/A"}},
                           "required": ["a", "b"], "additionalProperties": False},
    "pattern_properties": {"type": "object", "patternProperties": {"^a": {"type": "integer"}},
                           "additionalProperties": False},
    "discriminated": {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}},
                                 "required": ["k", "x"], "additionalProperties": False},
                                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"],
                                 "additionalProperties": False}], "discriminator": {"propertyName": "k"}},
}  # fmt: skip


@pytest.mark.parametrize("name", ENFORCED)
def test_random_walks_through_an_accepted_schema_end_in_valid_documents(compiler, tokenizer, name):
    """Each step a random allowed token (short ones first, EOS half the time it
    may end): what the grammar lets through must validate against the schema."""
    schema = ENFORCED[name]
    rng = random.Random(0)
    short = torch.tensor([len(tokenizer.decode([t])) <= 2 for t in range(len(tokenizer))])
    finished = 0
    for _ in range(8):
        s = state(compiler, json_schema=json.dumps(schema))
        tokens: list[int] = []
        while len(tokens) < 60 and not s.finished:
            logits = torch.zeros(1, len(tokenizer))
            mask_logits(logits, [s])
            allowed = torch.isfinite(logits[0])
            pool = (allowed & short).nonzero().flatten().tolist() or allowed.nonzero().flatten().tolist()
            token = EOS if allowed[EOS] and rng.random() < 0.5 else rng.choice(pool)
            assert s.accept(token)
            tokens.append(token)
        if s.finished:
            finished += 1
            jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), schema)
    assert finished >= 4


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"not": {"type": "string"}}, "not"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"type": "array", "contains": {"type": "string"}}}},
         "properties.a.contains"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf (of more than one schema)"),
        ({"anyOf": [{"oneOf": [{"type": "integer"}, {"minimum": 3}]}]}, "anyOf[0].oneOf (without a discriminator"),
        ({"$ref": "https://example.com/schema.json"}, "$ref (to another document)"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ],
)  # fmt: skip
def test_a_schema_feature_the_grammar_would_not_enforce_is_refused(compiler, schema, where):
    with pytest.raises(FieldError, match="not enforced") as err:
        state(compiler, json_schema=json.dumps(schema))
    assert where in str(err.value)


def test_a_property_named_like_a_keyword_is_no_keyword(compiler):
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"}}}
    assert state(compiler, json_schema=json.dumps(schema)).allows_anything()
