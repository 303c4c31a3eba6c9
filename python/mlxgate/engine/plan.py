"""One engine step's plan, and its wire form for the ranks (engine/lockstep.py carries it).

Rank 0 makes the plan between two steps (`Engine._plan`, the scheduler's decisions in it):
the requests taken in, the streams that end without finishing (their clients left or stopped
reading), the sequences preempted for the KV memory budget, the guesses the decode step
verifies, and the step's prefill (engine/scheduler.py's `PrefillPlan`). Every rank runs it: the
others are sent it, in the step's one share before the model runs, with rank 0's digest of its
state to check theirs against.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import numpy as np

from mlxgate._native import StreamSpec
from mlxgate.engine.contract import GenerationRequest
from mlxgate.engine.prefill import Pending
from mlxgate.engine.scheduler import PrefillPlan
from mlxgate.engine.speculation import Drafts


@dataclasses.dataclass
class StepPlan:
    """What one step does, beyond what the model computes."""

    running: bool  # False once the engine stops
    taken: list[Pending]  # admitted since the last step
    cancelled: list[int]  # streams whose clients left
    stalled: list[int]  # streams unread past the stall timeout (the router has ended them)
    state: list[int]  # rank 0's digest of its engine before the plan, to check the others'
    preempted: list[int] = dataclasses.field(default_factory=list)
    drafts: Drafts | None = None  # the guesses the decode step verifies; None: a plain decode
    prefill: PrefillPlan | None = None  # None: nothing waits for prefill

    def encode(self) -> list[Any]:
        taken = [_encoded_pending(pending) for pending in self.taken]
        drafts = self.drafts
        return [
            self.running,
            taken,
            self.cancelled,
            self.stalled,
            self.state,
            self.preempted,
            None if drafts is None else [drafts.counts.tolist(), drafts.tokens.tolist()],
            None if self.prefill is None else _encoded_prefill(self.prefill),
        ]

    @classmethod
    def decode(cls, encoded: list[Any]) -> StepPlan:
        running, taken, cancelled, stalled, state, preempted, drafts, prefill = encoded
        return cls(
            running,
            [_decoded_pending(pending) for pending in taken],
            cancelled,
            stalled,
            state,
            preempted,
            None if drafts is None else _decoded_drafts(drafts),
            None if prefill is None else _decoded_prefill(prefill),
        )


def _encoded_pending(pending: Pending) -> list[Any]:
    """What another rank needs of an admitted sequence (every choice of it)."""
    request = pending.request
    ids = [choice.stream_id for choice in pending.choices]
    return [ids, request.prompt_ids, request.max_tokens, pending.scaled, request.speculate]


def _decoded_pending(encoded: list[Any]) -> Pending:
    """Rank 0's admitted sequence on another rank: what its model calls need (no stream, no
    sampling: rank 0 samples)."""
    ids, prompt_ids, max_tokens, scaled, speculate = encoded
    request = GenerationRequest(
        prompt_ids, cast(StreamSpec, None), max_tokens, speculate=speculate, choices=len(ids)
    )
    lead, *siblings = [Pending(stream_id, request, None, scaled) for stream_id in ids]
    lead.siblings = siblings
    return lead


def _decoded_drafts(encoded: list[Any]) -> Drafts:
    counts, tokens = (np.array(a, dtype=np.int64) for a in encoded)
    return Drafts(counts, tokens)


def _encoded_prefill(plan: PrefillPlan) -> list[Any]:
    last_chunks = [[stream_id, *chunk] for stream_id, chunk in plan.last_chunks.items()]
    return [
        plan.budget,
        plan.allowance_s,
        plan.kv_room,
        plan.order,
        plan.token_s,
        last_chunks,
        plan.pass_s,
    ]


def _decoded_prefill(encoded: list[Any]) -> PrefillPlan:
    budget, allowance_s, kv_room, order, token_s, last_chunks, pass_s = encoded
    chunks = {stream_id: (tokens, seconds) for stream_id, tokens, seconds in last_chunks}
    return PrefillPlan(budget, allowance_s, kv_room, order, token_s, chunks, pass_s)
