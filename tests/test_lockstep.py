"""engine/lockstep.py between two real processes: MLX's ring backend over loopback, as
`mlxgate serve --ranks 2` starts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mlxgate.engine.lockstep import INLINE
from support.servers import free_port

RANK = """
import json, sys
import mlxgate  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
from mlxgate.engine.lockstep import INLINE, RankGroup

lockstep = RankGroup(mx.distributed.init(strict=True))
leader = lockstep.leader
seen = []
small = {"tokens": [[1, 2], [3, 4]], "ended": [7]}
large = list(range(3 * INLINE))  # past the first collective's INLINE bytes
for value in (small, large, None, "ünïcode"):
    seen.append(lockstep.share(lambda: value if leader else sys.exit("asked a follower")))
seen.append(lockstep.any(lockstep.rank == 1))
seen.append(lockstep.any(False))
print(json.dumps({"rank": lockstep.rank, "seen": seen, "shares": lockstep.shares}))
"""


def test_every_rank_gets_rank_0s_decisions(tmp_path: Path) -> None:
    """Small and large values alike (a second collective past INLINE bytes), only rank 0
    decides, and `any` is true on every rank if it holds on one."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile)}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK],
            env={**env, "MLX_RANK": str(rank)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [json.loads(process.communicate(timeout=60)[0]) for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0]
    large = list(range(3 * INLINE))
    for rank, output in enumerate(outputs):
        assert output["rank"] == rank
        assert output["seen"] == [
            {"tokens": [[1, 2], [3, 4]], "ended": [7]},
            large,
            None,
            "ünïcode",
            True,
            False,
        ]
        assert output["shares"] == 4


def test_a_step_plan_crosses_to_the_other_ranks_whole() -> None:
    """A plan as rank 0 makes it and as a follower decodes it from the wire (JSON): the same
    decisions (a follower's admitted sequences carry what its model calls need)."""
    import numpy as np
    import orjson

    from mlxgate.engine.contract import GenerationRequest
    from mlxgate.engine.plan import StepPlan
    from mlxgate.engine.prefill import Pending
    from mlxgate.engine.scheduler import PrefillPlan
    from mlxgate.engine.speculation import Drafts

    request = GenerationRequest([5, 6, 7], None, 40, speculate=False, choices=2)  # type: ignore[arg-type]
    lead, sibling = Pending(3, request, None, scaled=True), Pending(4, request, None, True)
    lead.siblings = [sibling]
    drafts = Drafts(np.array([2, 0]), np.array([[8, 9], [0, 0]]))
    prefill = PrefillPlan(64, 0.25, 1 << 30, [3, 9], 0.004, {9: (128, 0.5)}, 0.011)
    plan = StepPlan(True, [lead], [1], [2], [6, 21], [9], drafts, prefill)
    wire = orjson.dumps(plan.encode(), option=orjson.OPT_SERIALIZE_NUMPY)
    got = StepPlan.decode(orjson.loads(wire))
    assert (got.running, got.cancelled, got.stalled, got.state) == (True, [1], [2], [6, 21])
    assert got.preempted == [9] and got.prefill == prefill
    assert got.drafts is not None
    assert got.drafts.counts.tolist() == [2, 0] and got.drafts.tokens.tolist() == [[8, 9], [0, 0]]
    [taken] = got.taken
    assert [choice.stream_id for choice in taken.choices] == [3, 4]
    assert taken.request.prompt_ids == [5, 6, 7] and taken.request.max_tokens == 40
    assert taken.scaled and not taken.request.speculate and taken.request.choices == 2
    nothing = StepPlan.decode(orjson.loads(orjson.dumps(StepPlan(False, [], [], [], []).encode())))
    assert nothing == StepPlan(False, [], [], [], [])
