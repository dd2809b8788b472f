"""Drives a real scheduler core with a real model runner in one process, plans run in
order as they come (as the worker runs them) and results applied as the lane applies
them, until every request has ended."""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.worker.info import worker_info
from spillway.services.worker.kv_transfer import KVTransfer, connect_kv_store
from spillway.services.worker.runner import ModelRunner
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import (
    RequestDelta,
    SamplingParams,
    StepPlan,
    StepResult,
    SubmitRequest,
)
from spillway.shared.spill_keys import SpillKeys


@dataclass
class Served:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list] = field(default_factory=dict)
    finished: dict[str, RequestDelta] = field(default_factory=dict)

    def take(self, deltas: list[RequestDelta]) -> None:
        for d in deltas:
            self.outputs.setdefault(d.request_id, []).extend(d.token_ids)
            self.logprobs.setdefault(d.request_id, []).extend(d.logprobs or [])
            if d.finish_reason is not None:
                self.finished[d.request_id] = d


def drive(
    core: SchedulerCore,
    execute: Callable[[StepPlan], StepResult],
    request_ids: list[str],
    max_rounds: int = 3000,
) -> Served:
    """Runs ticks until every one of `request_ids` has ended and nothing is in flight;
    checks the core's bookkeeping whenever nothing is."""
    served = Served({r: [] for r in request_ids}, {r: [] for r in request_ids})
    inflight: deque[tuple[StepPlan, StepResult]] = deque()
    for _ in range(max_rounds):
        while core.can_schedule():
            plan = core.schedule()
            if plan is None:
                break
            inflight.append((plan, execute(plan)))
        if inflight:
            served.take(core.update_from_output(*inflight.popleft()))
        served.take(core.sweep_deadlines())
        while core.must_drain():
            served.take(core.update_from_output(*inflight.popleft()))
        served.take(core.finish_tick())
        if not inflight:
            core.check_integrity()
        if len(served.finished) == len(request_ids) and not inflight:
            break
    assert len(served.finished) == len(request_ids)
    return served


Execute = Callable[[StepPlan], StepResult]


def serve(
    runner: ModelRunner,
    config: SchedulerConfig,
    prompts: list[list[int]],
    sampling: SamplingParams,
    max_tokens: int,
    requests: list[dict] | None = None,
    spill_to: str | None = None,
    execute: Execute | None = None,
    driver: Callable[[SchedulerCore, Execute, list[str]], Served] = drive,
) -> tuple[Served, SchedulerCore]:
    """Serves `prompts` (request i: "r<i>", seed 100 + i, ignoring EOS, with `requests[i]`'s
    fields) on a fresh core driving `runner` (through `execute` where given, in its place)
    the way `driver` drives it; with `spill_to` (a Redis URL) preemption spills there.
    Every block is free and nothing swapped at the end."""
    if spill_to is not None:
        config = replace(config, preemption_mode="spill", spill_store=True)
        store = connect_kv_store(spill_to, 2.0)
        runner.kv_transfer = KVTransfer(store, SpillKeys(uuid.uuid4().hex[:8]), runner.kv_cache)
        runner.kv_transfer.state_pool = runner.state_pool
    core = SchedulerCore(FakeClock(), config)
    core.attach_worker(worker_info("w", "tiny", runner))
    if spill_to is not None:
        core.spill_store_reported(True, 1 << 40)
    requests = requests or [{} for _ in prompts]
    for i, (prompt, extra) in enumerate(zip(prompts, requests, strict=True)):
        fields = {"max_tokens": max_tokens, "ignore_eos": True, **extra}
        error = core.add_request(
            SubmitRequest(
                request_id=f"r{i}",
                gateway_id="g",
                prompt_token_ids=prompt,
                sampling=sampling.model_copy(update={"seed": 100 + i}),
                **fields,
            )
        )
        assert error is None
    served = driver(core, execute or runner.execute, [f"r{i}" for i in range(len(prompts))])
    assert core.kv_usage == 0.0 and core.num_swapped == 0
    return served, core
