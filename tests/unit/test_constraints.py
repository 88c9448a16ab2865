"""Constraints compiled against the real tokenizer, and their masks: the
mask equals xgrammar's own (its ``apply_token_bitmask_inplace``), touches
only constrained rows, keeps the greedy token wherever the grammar allows
it, and a constraint that does not compile names why."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar

from inference.constraints import Constraint, GrammarCompiler, mask_logits, new_bitmask
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
