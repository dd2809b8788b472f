"""The paged KV cache: per layer one K and one V tensor of fixed-size blocks, and the index
tensors (block tables, slot mappings) that address it.

    k[layer], v[layer]: [num_blocks, block_size, num_kv_heads, head_dim]

A multi-head latent attention model (DeepSeek-V3) caches one plane: its V is its K (the
same tensors), each token's compressed latent and rotated key read as both; a block's bytes
then hold that plane once (`planes`).

A token at position p of a sequence with block list B lives at slot
B[p // block_size] * block_size + p % block_size.

One block beyond `num_blocks` (`pad_block`) is never handed out: the padding rows of a
decode CUDA graph attend to it. Nothing ever writes it, so it holds zeros for good and a
padding row computes finite numbers without touching any sequence's blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from spillway.shared.model_config import ModelConfig

log = logging.getLogger(__name__)


KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_kv_dtype(setting: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype: `auto` is the model's dtype. On the CPU the cache may differ from
    the model's (the native attention reads float32 or bfloat16 with float32 arithmetic,
    the torch path widens what it gathers); on CUDA the kernels take the model's only."""
    if setting == "auto":
        return model_dtype
    if setting not in KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype {setting}: one of auto, {', '.join(KV_DTYPES)}")
    dtype = KV_DTYPES[setting]
    if device.type != "cpu" and dtype != model_dtype:
        model = str(model_dtype).removeprefix("torch.")
        raise ValueError(
            f"--kv-cache-dtype {setting}: on {device.type} the KV cache is the model's dtype"
            f" ({model}); give --kv-cache-dtype auto or --dtype {setting}"
        )
    return dtype


def kv_planes(config: ModelConfig) -> int:
    """2 (K and V), or 1 where V is K (multi-head latent attention)."""
    return 1 if config.mla is not None else 2


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    per_layer = block_size * config.num_kv_heads * config.head_dim * dtype.itemsize
    return kv_planes(config) * config.num_layers * per_layer


def num_blocks_for_memory(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    cpu_cache_bytes: int,
    gpu_memory_utilization: float,
) -> int:
    """How many blocks fit: a fixed budget on CPU; on CUDA a share of the memory still free
    (call it after the weights are loaded)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_memory_utilization)
    else:
        budget = cpu_cache_bytes
    blocks = budget // block_bytes(config, block_size, dtype)
    if blocks < 1:
        raise MemoryError(f"no room for a single KV block in {budget} bytes")
    return blocks


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        self.num_blocks = num_blocks  # blocks the scheduler may hand out: 0..num_blocks - 1
        self.pad_block = num_blocks
        self.block_size = block_size
        self.planes = kv_planes(config)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = (
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
            if self.planes == 2
            else self.k
        )
        log.info(
            "KV cache: %d blocks x %d tokens, %.1f MiB",
            num_blocks,
            block_size,
            num_blocks * block_bytes(config, block_size, dtype) / 2**20,
        )

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of one layer's K (or V): [BS, Hkv, D]."""
        return tuple(self.k[0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' K and V across every layer, on the host and contiguous:
        [P, L, n, BS, Hkv, D] with P = `planes` (what a spilled or shared block holds)."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.k[0].device)
        k = torch.stack([layer.index_select(0, idx) for layer in self.k])  # [L, n, BS, H, D]
        if self.planes == 1:
            return k.unsqueeze(0).cpu().contiguous()
        v = torch.stack([layer.index_select(0, idx) for layer in self.v])
        return torch.stack([k, v]).cpu().contiguous()

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """The inverse of read_blocks: data [P, L, n, BS, Hkv, D] into these blocks."""
        device = self.k[0].device
        idx = torch.tensor(block_ids, dtype=torch.int64, device=device)
        data = data.to(device=device, dtype=self.dtype)
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k.index_copy_(0, idx, data[0, layer])
            if self.planes == 2:
                v.index_copy_(0, idx, data[1, layer])


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def block_table_tensor(block_lists: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[R, MB] int32, rows padded with 0 (padding is never read: context_lens bound it)."""
    width = max((len(b) for b in block_lists), default=0) or 1
    padded = [[*blocks, *([0] * (width - len(blocks)))] for blocks in block_lists]
    return torch.tensor(padded, dtype=torch.int32).to(device)


def slot_mapping_tensor(
    block_tables: torch.Tensor,  # [R, MB] int32
    token_rows: torch.Tensor,  # [T] int64: the row of each token
    positions: torch.Tensor,  # [T] int64
    block_size: int,
) -> torch.Tensor:
    """[T] int64: the cache slot of each token."""
    blocks = block_tables[token_rows, positions // block_size].long()  # [T]
    return blocks * block_size + positions % block_size
