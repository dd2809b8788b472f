"""The spill store's Redis key space, namespaced so that several systems share one Redis.
Workers write and read the KV values directly; the spill store owns the rest.

    <NS:>spill:seq:<seq_id>:<spill_id>:<group>   one value per group of spilled blocks
    <NS:>spill:seq:<seq_id>:<spill_id>:state     a hybrid model's recurrent state
    <NS:>spill:index                             hash: "<seq_id>:<spill_id>" -> record
    <NS:>prefix:block:<hash>                     one full block of the shared prefix tier
    <NS:>prefix:state:<hash>                     a hybrid model's state after that block
    <NS:>prefix:index                            sorted set: hash -> time stored
    <NS:>spillstore:probe                        a short-lived key the spill store
                                                 writes to learn whether Redis takes writes
"""

from __future__ import annotations

from spillway.shared.subjects import Namespace

SPILL_PREFIX = "spill:"
PREFIX_TIER = "prefix:"


class SpillKeys:
    def __init__(self, namespace: str = "") -> None:
        self.ns = Namespace(namespace)

    def block_group(self, seq_id: str, spill_id: int, group: int) -> str:
        return self.ns.redis_key(f"{SPILL_PREFIX}seq:{seq_id}:{spill_id}:{group}")

    def state(self, seq_id: str, spill_id: int) -> str:
        """A spilled sequence's recurrent state (hybrid models), beside its blocks."""
        return self.ns.redis_key(f"{SPILL_PREFIX}seq:{seq_id}:{spill_id}:state")

    def spill_pattern(self, seq_id: str, spill_id: int) -> str:
        """Every value of one spill (to delete one whose record never came)."""
        return self.ns.redis_key(f"{SPILL_PREFIX}seq:{seq_id}:{spill_id}:*")

    def values_pattern(self) -> str:
        """Every spill's values (not the index)."""
        return self.ns.redis_key(f"{SPILL_PREFIX}seq:*")

    def spill_of(self, key: str) -> str | None:
        """The spill (`spill_name`) a value key belongs to; None for any other key."""
        head = self.ns.redis_key(f"{SPILL_PREFIX}seq:")
        if not key.startswith(head):
            return None
        parts = key[len(head) :].rsplit(":", 2)  # seq_id, spill_id, group or "state"
        return f"{parts[0]}:{parts[1]}" if len(parts) == 3 and parts[1].isdigit() else None

    def index(self) -> str:
        return self.ns.redis_key(f"{SPILL_PREFIX}index")

    def pattern(self) -> str:
        """Every spill key this system owns."""
        return self.ns.redis_key(f"{SPILL_PREFIX}*")

    def prefix_block(self, block_hash: str) -> str:
        return self.ns.redis_key(f"{PREFIX_TIER}block:{block_hash}")

    def prefix_state(self, block_hash: str) -> str:
        return self.ns.redis_key(f"{PREFIX_TIER}state:{block_hash}")

    def prefix_index(self) -> str:
        return self.ns.redis_key(f"{PREFIX_TIER}index")

    def probe(self) -> str:
        return self.ns.redis_key("spillstore:probe")


def spill_name(seq_id: str, spill_id: int) -> str:
    """A spill's field in the index hash."""
    return f"{seq_id}:{spill_id}"
