"""What a worker tells its scheduler about itself at registration (no bus here: the
worker's GPU image and in-process tests build it without NATS)."""

from __future__ import annotations

import uuid

from spillway.services.worker.kv_cache import block_bytes
from spillway.services.worker.kv_transfer import cache_block_bytes
from spillway.services.worker.runner import ModelRunner
from spillway.shared.protocol import WorkerInfo


def worker_info(worker_id: str, model_id: str, runner: ModelRunner) -> WorkerInfo:
    config = runner.model.config
    transfer = runner.kv_transfer
    return WorkerInfo(
        worker_id=worker_id,
        model_id=model_id,
        num_kv_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        vocab_size=config.vocab_size,
        eos_token_ids=list(config.eos_token_ids),
        device=str(runner.model.device),
        dtype=str(runner.model.dtype).removeprefix("torch."),
        kv_layout=runner.kv_layout,
        # What a block costs to spill: a drafter's blocks go with the target's.
        block_bytes=block_bytes(config, runner.block_size, runner.kv_cache.dtype)
        + sum(cache_block_bytes(c) for c in runner.drafter_caches()),
        kv_store=transfer is not None and transfer.ping(),
        boot_id=uuid.uuid4().hex,
        num_state_slots=0 if runner.state_pool is None else runner.state_pool.num_slots,
        state_slot_bytes=0 if runner.state_pool is None else runner.state_pool.slot_bytes(),
        num_state_snapshots=runner.num_state_snapshots,
        max_verify_tokens=runner.max_verify_tokens,
    )
