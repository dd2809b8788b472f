"""Chained block hashes: the identity of a full KV block's contents.

    h[0] = H(root, tokens[0:B])      h[i] = H(h[i-1], tokens[i*B:(i+1)*B])

`root` names the KV layout (model, dtype, block size: `WorkerInfo.kv_layout`), so
blocks of different models or precisions never match. The hash is a stable 128-bit
digest rather than Python's `hash`, because the shared prefix tier keys Redis with it
across processes and restarts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

HASH_BYTES = 16


def layout_root(kv_layout: str) -> int:
    digest = hashlib.blake2b(kv_layout.encode(), digest_size=HASH_BYTES).digest()
    return int.from_bytes(digest, "little")


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    h = hashlib.blake2b(parent.to_bytes(HASH_BYTES, "little"), digest_size=HASH_BYTES)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def extend_hashes(
    hashes: list[int], token_ids: Sequence[int], block_size: int, root: int
) -> list[int]:
    """Appends to `hashes` (the chain so far) the hashes of every further full block of
    `token_ids`; returns the same list."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


def hash_hex(h: int) -> str:
    """The form the shared prefix tier uses in Redis keys."""
    return h.to_bytes(HASH_BYTES, "little").hex()
