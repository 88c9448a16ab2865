"""A completions request's prompts scored once per shared prefix (``echo`` with ``logprobs``).

lm-eval's multiple-choice requests are one context followed by each choice,
several in one request. A cached prefix has no logits, so a scored prompt
is computed from its first scored position on, not served by the cache.
Scored one by one, each choice would compute the context again; here a
prompt that shares at least a block and one more token with an earlier
prompt of the request follows it (``share_prefixes``): it starts once that
one's prompt is computed (``prompt_batch.batch_messages``), asks the engine
for logprobs only from the first position where the two may differ (the
cache serves its blocks before that), and takes the earlier prompt's
logprobs for the positions before (``PromptScores``): those positions see
the same tokens, so they have the same logprobs. The ``n`` forks of a
scored prompt take its first fork's logprobs whole (``forks_share_scores``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

#: Earlier prompts a prompt is compared with (lm-eval sends a context's choices together).
LOOK_BACK = 16


def share_prefixes(requests: Sequence[pb.GenerateRequest], block_size: int) -> dict[int, int]:
    """Points each token-id request that shares a block and a token more with
    an earlier one at the earlier one with the longest shared prefix: sets its
    ``sampling.prompt_logprobs_from`` to the first position they may differ
    at. Returns follower -> the request it follows."""
    leaders: dict[int, int] = {}
    prompts = [list(request.token_ids.ids) for request in requests]
    for index, request in enumerate(requests):
        best, shared = -1, 0
        for earlier in range(max(0, index - LOOK_BACK), index):
            n = len(os.path.commonprefix([prompts[index], prompts[earlier]]))
            if n > shared:
                best, shared = earlier, n
        # Its logits at position shared - 1 score the first token that may differ:
        # the positions before it must fill a block for the cache to serve any.
        if shared - 1 >= block_size:
            request.sampling.prompt_logprobs_from = shared
            leaders[index] = best
    return leaders


def forks_share_scores(requests: Sequence[pb.GenerateRequest], leaders: Mapping[int, int]) -> None:
    """Makes each fork of a scored prompt (``n`` > 1) score nothing itself:
    the cache serves it the prompt its leader computed, and ``PromptScores``
    gives it the leader's logprobs."""
    for fork in leaders:
        requests[fork].sampling.prompt_logprobs_from = len(requests[fork].token_ids.ids)


class PromptScores:
    """Completes each follower's prompt logprobs with its leader's, message by
    message (a leader's come first: its follower starts after them)."""

    def __init__(self, leaders: Mapping[int, int]) -> None:
        self.leaders = leaders
        self._kept = set(leaders.values())
        self._scores: dict[int, epb.PromptLogprobs] = {}

    def complete(self, index: int, message: pb.GenerateResponse) -> pb.GenerateResponse:
        if not message.HasField("prompt_logprobs"):
            return message
        leader = self.leaders.get(index)
        if leader is not None:
            message.prompt_logprobs.CopyFrom(_joined(self._scores[leader], message.prompt_logprobs))
        if index in self._kept:
            self._scores[index] = message.prompt_logprobs
        return message


def _joined(leader: epb.PromptLogprobs, own: epb.PromptLogprobs) -> epb.PromptLogprobs:
    """``own``'s logprobs preceded by ``leader``'s for the positions before its first."""
    taken = own.first_position - leader.first_position
    out = epb.PromptLogprobs(token_ids=own.token_ids, first_position=leader.first_position)
    out.logprobs.extend(leader.logprobs[:taken])
    out.logprobs.extend(own.logprobs)
    if own.top_logprobs or leader.top_logprobs:
        out.top_logprobs.extend(leader.top_logprobs[:taken])
        out.top_logprobs.extend(own.top_logprobs)
    return out
