"""One rank of a two-rank expert-parallel worker serving with speculative decoding, as
its own process, for the tests:

    python -m tests.integration.ep_spec_ranks RANK SIZE DIST_URL CASES_JSON

CASES_JSON lists the cases, each {"out", "model", "method", "draft", "dist_url"}, which
the process serves one after the other (one process start for them all): for each, the
ranks meet anew (the first case at DIST_URL, each later one at its own `dist_url`, so that
no rank reaches the store of the group the other rank is still closing), rank 0 serves
the prompts greedily through a real scheduler core (which drafts, or whose worker's draft
model does) while the other ranks follow its plans, and rank 0 writes the outputs and the
speculation totals to the case's `out`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.worker.ep_group import close_group, follow, leave
from spillway.services.worker.loading import load_runner
from spillway.shared.config import load_settings
from spillway.shared.protocol import SampledLogprobs, SamplingParams
from tests.integration.in_process import serve

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 3,
    [(7 * j) % 200 + 3 for j in range(13)],
    [40, 41, 42, 40, 41, 43, 40, 41, 42, 40, 41],
]
NEW_TOKENS = 40
K = 3


# Greedy, with each sampled token's logprob: a rank whose layers went wrong shows there
# even where the tokens happen to agree.
GREEDY = SamplingParams(temperature=0.0, logprobs=0)


def logprobs(served: dict[str, list[SampledLogprobs]]) -> dict[str, list[float]]:
    return {r: [x.logprob for x in lps] for r, lps in served.items()}


def scheduler_config(method: str) -> SchedulerConfig:
    return SchedulerConfig(
        max_batch=4, max_num_batched_tokens=24, speculative=method,  # type: ignore[arg-type]
        num_speculative_tokens=K, spec_draft_cost=0.1,
    )  # fmt: skip


def main(rank: int, size: int, url: str, cases: list[dict]) -> None:
    torch.set_num_threads(1)
    for i, case in enumerate(cases):
        serve_case(rank, size, url if i == 0 else case["dist_url"], case)


def serve_case(rank: int, size: int, url: str, case: dict) -> None:
    method, draft = case["method"], case["draft"]
    settings = load_settings(
        model=case["model"], kv_blocks=64, block_size=4, device="cpu", dtype="float32",
        expert_parallel=size, rank=rank, dist_url=url, speculative=method,
        num_speculative_tokens=K, draft_model=draft or None,
        # Rank 0 plans in this process between steps (no keepalive while it does): a busy
        # machine must not break the group.
        ep_timeout_s=120.0,
    )  # fmt: skip
    runner, _ = load_runner(settings)
    group = runner.experts
    assert group is not None and group.size == size
    if rank != 0:
        follow(runner, group)
        close_group()
        return
    served, core = serve(runner, scheduler_config(method), PROMPTS, GREEDY, NEW_TOKENS)
    leave(group)
    close_group()
    totals = core.spec.totals if core.spec is not None else None
    report = {
        "outputs": served.outputs,
        "logprobs": logprobs(served.logprobs),
        "draft_tokens": totals.draft_tokens if totals else 0,
        "accepted_tokens": totals.accepted_tokens if totals else 0,
    }
    Path(case["out"]).write_text(json.dumps(report))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(Path(sys.argv[4]).read_text()))
