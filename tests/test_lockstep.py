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
