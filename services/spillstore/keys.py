"""The spill store's Redis key space, namespaced so that several systems share one Redis.

<NS:>spill:seq:<seq_id>:<group>   one key per spilled block group (bytes)
<NS:>spill:index                  hash: seq_id -> number of groups (accounting)
"""

from __future__ import annotations

from shared.subjects import Namespace

SPILL_PREFIX = "spill:"


class SpillKeys:
    def __init__(self, namespace: str = "") -> None:
        self.ns = Namespace(namespace)

    def block_group(self, seq_id: str, group: int) -> str:
        return self.ns.redis_key(f"{SPILL_PREFIX}seq:{seq_id}:{group}")

    def index(self) -> str:
        return self.ns.redis_key(f"{SPILL_PREFIX}index")

    def pattern(self) -> str:
        """Every key this system's spill store owns."""
        return self.ns.redis_key(f"{SPILL_PREFIX}*")
