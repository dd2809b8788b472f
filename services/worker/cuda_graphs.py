"""CUDA graphs for all-decode steps: one launch replays a whole decode forward.

A decode step is a few hundred small kernels whose launch cost rivals their run time at small
batches. For each bucket size B (`graph_batch_sizes`) the forward (embedding -> layers ->
final norm -> lm_head) is captured once on static buffers sized for the largest bucket:

    token_ids    [Bmax] int64      padding rows: 0
    positions    [Bmax] int64      padding rows: 0
    slot_mapping [Bmax] int64      padding rows: -1, so store_kv writes nothing for them
    context_lens [Bmax] int32      padding rows: 1
    block_tables [Bmax, MB] int32  padding rows: the KV cache's pad block (zeros, never written)
    logits       [Bmax, V] float32 the output; row r belongs to the step's row r

A step of R rows replays the smallest bucket B >= R: its inputs are padded to B rows on the
host, copied into the first B rows of the buffers, and graph B replays. A padding row
attends to one zero key of the pad block: finite, and in a row of its own that no real row
reads. Table columns past a real row's blocks keep stale ids that its context never reaches.

Nothing a replay depends on may vary between steps, so decode attention's split count is
fixed at capture from B and the maximum model length (split-K covers any context up to it),
and no step length is read back to the host. Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

import torch

from spillway.services.worker.forward_batch import ForwardBatch
from spillway.services.worker.kv_cache import KVCache, blocks_needed
from spillway.services.worker.models.llama import LlamaModel

log = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int, sizes: Sequence[int] | None = None) -> list[int]:
    """The bucket sizes to capture: `sizes` when given, else 1, 2, 4, 8, 16, 24, 32, 48, 64,
    then steps of 32 to 256 and of 64 beyond, up to max_batch (always included)."""
    if sizes:
        chosen = {s for s in sizes if s >= 1}
        if not chosen:
            raise ValueError(f"no usable CUDA graph batch size in {list(sizes)}")
        return sorted(chosen)
    ladder = [1, 2, 4, 8, 16, 24, 32, 48, 64, *range(96, 257, 32)]
    ladder += range(320, max_batch + 1, 64)
    return sorted({s for s in ladder if s < max_batch} | {max_batch})


def bucket_for(rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest size holding `rows` (sizes ascending), or None when none does."""
    return next((s for s in sizes if s >= rows), None)


def pad_decode_batch(batch: ForwardBatch, bucket: int, pad_block: int) -> ForwardBatch:
    """A host decode batch of R rows padded to `bucket` rows that write nothing and read
    only the pad block. Only the fields a decode graph reads are padded."""
    rows = batch.token_ids.shape[0]
    extra = bucket - rows
    assert batch.decode_only and extra >= 0, f"{rows} decode rows do not fit {bucket}"
    if extra == 0:
        return batch

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])

    return replace(
        batch,
        token_ids=pad(batch.token_ids, 0),
        positions=pad(batch.positions, 0),
        slot_mapping=pad(batch.slot_mapping, -1),
        context_lens=pad(batch.context_lens, 1),
        block_tables=pad(batch.block_tables, pad_block),
    )


class Capture(Protocol):
    """Turns a forward over static buffers into a replay of it."""

    def __call__(self, run: Callable[[], None]) -> Callable[[], None]: ...


class CudaGraphCapture:
    """Captures into CUDA graphs sharing one memory pool (capture the largest first: the
    smaller graphs then fit in what it freed, since graphs never run at once)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, run: Callable[[], None]) -> Callable[[], None]:
        # Warm-up outside the graph: Triton compiles its kernels for these shapes and cuBLAS
        # picks its algorithms, neither of which may happen during capture.
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run()
        return graph.replay


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        sizes: Sequence[int],
        max_model_len: int,
        capture: Capture | None = None,
    ) -> None:
        self.sizes = sorted(sizes)
        self.pad_block = kv_cache.pad_block
        device, largest = model.device, self.sizes[-1]
        max_blocks = blocks_needed(max_model_len, kv_cache.block_size)
        with torch.inference_mode():
            self.token_ids = torch.zeros(largest, dtype=torch.int64, device=device)
            self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
            self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
            self.block_tables = torch.full(
                (largest, max_blocks), self.pad_block, dtype=torch.int32, device=device
            )
            # Decode rows: row r's one query is token r.
            self.query_start = torch.arange(largest + 1, dtype=torch.int32, device=device)
            self.logits = torch.zeros(
                largest, model.config.vocab_size, dtype=torch.float32, device=device
            )
            capture = capture or CudaGraphCapture()
            start = time.perf_counter()
            self.replays: dict[int, Callable[[], None]] = {}
            for size in reversed(self.sizes):
                batch = self._static_batch(size, max_model_len)

                def run(batch: ForwardBatch = batch, size: int = size) -> None:
                    self.logits[:size].copy_(model.forward(batch, kv_cache))

                self.replays[size] = capture(run)
        log.info(
            "decode graphs for batch sizes %s captured in %.1f s",
            self.sizes,
            time.perf_counter() - start,
        )

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def covers(self, batch: ForwardBatch) -> bool:
        return batch.decode_only and batch.token_ids.shape[0] <= self.max_batch

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [R, V] float32 of every row of a host decode batch (a view of the static
        output: valid until the next replay)."""
        rows = batch.token_ids.shape[0]
        bucket = bucket_for(rows, self.sizes)
        assert bucket is not None, f"{rows} rows exceed the largest graph ({self.max_batch})"
        padded = pad_decode_batch(batch, bucket, self.pad_block)
        width = padded.block_tables.shape[1]
        with torch.inference_mode():
            for static, host in (
                (self.token_ids, padded.token_ids),
                (self.positions, padded.positions),
                (self.slot_mapping, padded.slot_mapping),
                (self.context_lens, padded.context_lens),
            ):
                static[:bucket].copy_(host, non_blocking=True)
            self.block_tables[:bucket, :width].copy_(padded.block_tables, non_blocking=True)
            self.replays[bucket]()
        return self.logits[:rows]

    def _static_batch(self, size: int, max_model_len: int) -> ForwardBatch:
        return ForwardBatch(
            token_ids=self.token_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_start=self.query_start[: size + 1],
            logits_indices=None,
            max_query_len=1,
            # The split count must hold for every context a replay may see.
            max_context_len=max_model_len,
            decode_only=True,
        )
