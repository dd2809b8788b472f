"""One rank of a two-rank group that steps until something breaks it, for the failure
tests:

    python -m tests.unit.worker.ep_steps RANK DIST_URL FOLDER

Rank 0 generates over and over through `ModelRunner.execute` (printing `stepping` once
its first batch is done), rank 1 follows. A broken group ends the process with code 3.
"""

from __future__ import annotations

import sys

import torch

from spillway.services.worker.ep_group import follow
from spillway.services.worker.loading import load_runner
from spillway.shared.config import load_settings
from tests.unit.worker.ep_ranks import KV_BLOCKS, PROMPTS
from tests.unit.worker.plans import generate


def main(rank: int, url: str, folder: str) -> None:
    torch.set_num_threads(1)
    settings = load_settings(
        model=folder, kv_blocks=KV_BLOCKS, device="cpu", dtype="float32",
        expert_parallel=2, rank=rank, dist_url=url, ep_timeout_s=2.0,
    )  # fmt: skip
    runner, _ = load_runner(settings)
    group = runner.experts
    assert group is not None
    if rank != 0:
        follow(runner, group)
        return
    first = True
    while True:
        runner.forget_all()
        generate(runner, PROMPTS, 4)
        if first:
            print("stepping", flush=True)
            first = False


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
