"""One rank of a two-rank expert-parallel group, as its own process, for the tests:

    python -m tests.unit.worker.ep_ranks RANK SIZE DIST_URL OUT_JSON FOLDER...

For every model folder and both exchanges, rank 0 generates greedily through
`ModelRunner.execute` (which hands every plan to the other ranks) while the others follow,
then every rank runs one packed forward of the prompts; each rank writes its tokens (rank
0), logits and step counters to OUT_JSON.<rank>.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from spillway.services.worker.ep_group import follow, leave
from spillway.services.worker.expert_parallel import EXCHANGES
from spillway.services.worker.kv_cache import KVCache
from spillway.services.worker.loader import load_model
from spillway.services.worker.loading import load_runner
from spillway.services.worker.models.llama import LlamaModel
from spillway.services.worker.runner import ModelRunner
from spillway.shared.config import load_settings
from spillway.shared.model_files import resolve_model
from tests.unit.worker.plans import generate
from tests.unit.worker.tiny_families import packed_batch

PROMPTS = [[1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5], [1, 200], [1, 64, 65, 66, 67, 68, 9]]
NEW_TOKENS = 8
KV_BLOCKS = 64


def main(rank: int, size: int, url: str, out: Path, folders: list[str]) -> None:
    torch.set_num_threads(1)
    report = []
    group = None
    for folder in folders:
        if group is None:  # the first model joins the group
            settings = load_settings(
                model=folder, kv_blocks=KV_BLOCKS, device="cpu", dtype="float32",
                expert_parallel=size, rank=rank, dist_url=url,
            )  # fmt: skip
            first, _ = load_runner(settings)
            group, model = first.experts, first.model
        else:
            config, weights = load_model(resolve_model(folder), torch.device("cpu"), torch.float32)
            group.shard(weights.layers)
            model = LlamaModel(config, weights, first.model.ops)
            model.experts = group
        assert group is not None
        for exchange in EXCHANGES:
            group.exchange = exchange
            runner = ModelRunner(
                model, KVCache(model.config, KV_BLOCKS, 16, torch.float32, torch.device("cpu"))
            )
            if rank == 0:
                tokens = generate(runner, PROMPTS, NEW_TOKENS, chunk=4, start_steps=[0, 1, 3])
                leave(group)
            else:
                follow(runner, group)
            # One packed prefill of every prompt, run by every rank; rank 0's counters.
            group.start_step(model.config.moe.num_experts if model.config.moe else 0)
            with torch.inference_mode():
                logits = model.forward(packed_batch(PROMPTS, 16), runner.kv_cache)
            c = group.counters
            report.append(
                dict(
                    folder=folder, exchange=exchange, tokens=tokens if rank == 0 else None,
                    logits=logits.tolist(), expert_tokens=c.expert_tokens, bytes=c.bytes,
                )
            )  # fmt: skip
    Path(f"{out}.{rank}").write_text(json.dumps(report))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5:])
