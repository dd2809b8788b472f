"""A worker belongs to one scheduler: it joins a live one that drives no worker, takes
plans from it alone (a foreign plan cannot touch its KV cache), answers the registration
probe of anyone, and moves to another scheduler when its own stops answering."""

from __future__ import annotations

import asyncio
import uuid

from spillway.services.worker.service import serve
from spillway.shared import subjects
from spillway.shared.bus import Bus
from spillway.shared.config import load_settings
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepResult, StepRow
from tests.integration.worker.test_worker_service import (
    LOAD_TIMEOUT_S,
    SchedulerDouble,
    _prefill_plan,
)
from tests.unit.worker.tiny_llama import tiny_runner

WORKER = "w-owned"


def _hostile_plan(step_id: int) -> StepPlan:
    """Well-formed, and aimed at the blocks seq-a uses (9 and 4)."""
    return StepPlan(
        step_id=step_id,
        new_seqs=[NewSequence(seq_id="evil", sampling=SamplingParams(), block_ids=[9, 4])],
        rows=[StepRow(seq_id="evil", token_ids=[7] * 20, start_pos=0, sample=True)],
    )


async def test_worker_takes_plans_from_its_scheduler_only_and_moves_when_it_dies(
    nats_url, tiny_llama_dir
):
    namespace = f"own{uuid.uuid4().hex[:8]}"
    settings = load_settings(
        model=str(tiny_llama_dir),
        nats_url=nats_url,
        namespace=namespace,
        service_id=WORKER,
        kv_blocks=64,
        device="cpu",
        dtype="float32",
        heartbeat_interval_s=0.1,
        scheduler_timeout_s=1.0,
    )
    a = SchedulerDouble(await Bus.connect(nats_url, namespace, "sched-a"), "sched-a")
    b = SchedulerDouble(await Bus.connect(nats_url, namespace, "sched-b"), "sched-b")
    for double in (a, b):
        await double.answer_registrations()
    await a.collect_heartbeats()
    stop = asyncio.Event()
    worker = asyncio.create_task(serve(settings, stop))
    try:
        waits = {asyncio.ensure_future(d.registrations.get()) for d in (a, b)}
        done, pending = await asyncio.wait(
            waits, timeout=LOAD_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        for wait in pending:
            wait.cancel()  # or it would take the next registration from that queue
        assert done, "the worker never registered"
        owner, other = (a, b) if a.workers else (b, a)
        step = subjects.worker_step(WORKER)

        # The probe (a plan that changes nothing) is answered for anyone.
        probe = await other.bus.request(step, StepPlan(step_id=0), StepResult, 10)
        assert probe.error is None

        plan = _prefill_plan(1, "seq-a")
        first = await owner.bus.request(step, plan, StepResult, 30)
        assert first.error is None
        expected = tiny_runner(tiny_llama_dir).execute(plan)
        assert first.rows == expected.rows

        # A foreign plan aimed at seq-a's blocks is refused whole...
        foreign = await other.bus.request(step, _hostile_plan(2), StepResult, 30)
        assert foreign.error is not None and foreign.error.code == "not_my_scheduler"
        # ...so seq-a decodes exactly as it would have without it.
        token = first.rows[0].token_id
        decode = StepPlan(
            step_id=3,
            rows=[
                StepRow(
                    seq_id="seq-a", token_ids=[token], start_pos=18, sample=True, output_index=1
                )
            ],
        )
        reference = tiny_runner(tiny_llama_dir)
        reference.execute(plan)
        after = await owner.bus.request(step, decode, StepResult, 30)
        assert after.error is None and after.rows == reference.execute(decode).rows

        # Its scheduler dies (no lease any more): the worker joins the live one.
        await owner.lease.stop()
        moved = await asyncio.wait_for(other.registrations.get(), 10)
        assert moved.worker_id == WORKER
        taken = await other.bus.request(step, _prefill_plan(4, "seq-b"), StepResult, 30)
        assert taken.error is None
        stale = await owner.bus.request(step, _prefill_plan(5, "seq-c"), StepResult, 30)
        assert stale.error is not None and stale.error.status == 403
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)
        for double in (a, b):
            await double.lease.stop()
            await double.bus.close()
