"""A worker's expert-parallel group as processes: the rendezvous, the agreement on the KV
pool, and the followers' loop.

Rank 0 is the worker the scheduler sees (registration, heartbeats, replies); ranks 1..N-1
never touch the bus. Every plan rank 0 runs goes to them first (`ModelRunner.execute`
shares it), in its order; while idle, rank 0 shares `KEEPALIVE` every heartbeat interval
so a follower's wait for the next plan never reaches the group's timeout, and `STOP` when
it stops. A follower whose rank 0 dies sees the group break and exits.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from spillway.services.worker.expert_parallel import ExpertGroup
from spillway.shared.config import Settings
from spillway.shared.protocol import StepPlan

log = logging.getLogger(__name__)

KEEPALIVE = None
STOP = "stop"
# The rendezvous waits for every rank to load its weights.
RENDEZVOUS_TIMEOUT_S = 300.0


def join_group(settings: Settings, device: torch.device) -> ExpertGroup:
    """The rendezvous (every rank of the group calls it) and this rank's ExpertGroup."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    n, rank = settings.expert_parallel, settings.rank
    log.info(
        "expert parallel: rank %d of %d joining at %s (%s)", rank, n, settings.dist_url, backend
    )
    dist.init_process_group(
        backend,
        init_method=settings.dist_url,
        rank=rank,
        world_size=n,
        timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
    )
    # The steps' collectives run on a group of their own, with the short timeout: a rank
    # that stops answering breaks the group within it.
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=settings.ep_timeout_s))
    ep = ExpertGroup(rank, n, settings.ep_exchange, group, settings.ep_timeout_s)
    ep.start_watchdog()
    return ep


def agree_num_blocks(num_blocks: int) -> int:
    """Every rank's KV pool has the same blocks (the plans name them): the smallest."""
    if not dist.is_initialized():
        return num_blocks
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, num_blocks)
    return min(int(c) for c in counts)


def follow(runner: Any, group: ExpertGroup) -> None:
    """A follower's life: rank 0's plans, run in its order, until it stops (or the group
    breaks, which ends the process)."""
    while True:
        message = group.share(None)
        if message is KEEPALIVE:
            continue
        if message == STOP:
            log.info("rank 0 stopped: rank %d leaves", group.rank)
            return
        if not isinstance(message, StepPlan):
            raise TypeError(f"rank 0 sent {type(message).__name__}, not a plan")
        result = runner.execute(message)
        if result.error is not None:
            log.warning("step %d: %s", message.step_id, result.error.message)


def leave(group: ExpertGroup | None) -> None:
    """Rank 0 stopping: the followers leave too."""
    if group is None or group.size == 1 or group.broken:
        return
    try:
        group.share(STOP)
    except Exception:  # a broken group exits on its own
        log.warning("could not tell the other ranks to stop")


def close_group() -> None:
    """Tears this rank's process groups down as its process ends (a local step, no
    collective; after it, no collective works): left to the interpreter's exit, gloo's
    threads were destroyed while still joinable now and then and the process aborted
    ("terminate called without an active exception", SIGABRT) after its work was done."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as e:  # the process is leaving anyway
        log.warning("expert-parallel group not torn down: %s", e)
