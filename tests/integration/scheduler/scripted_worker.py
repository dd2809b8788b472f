"""A worker test double on the real bus: registers (its heartbeats then name the scheduler
that took it), heartbeats, answers steps with deterministic tokens, and can be told to
fail a step, hold its steps, or fall silent; it may confirm every spill it is asked for
(as if written) and log in as the `worker` NATS user. The scheduler's registration probe
(a plan that changes nothing) is answered and not recorded."""

from __future__ import annotations

import asyncio
import contextlib

from spillway.shared import subjects
from spillway.shared.bus import Bus, BusError
from spillway.shared.protocol import (
    ErrorInfo,
    Heartbeat,
    RegisterReply,
    RowResult,
    SpillOutcome,
    StepPlan,
    StepResult,
)
from tests.unit.scheduler.harness import worker_info


def scripted_token(seq_id: str, output_index: int) -> int:
    """Never EOS (2): every id lands in [100, 900)."""
    return 100 + (sum(map(ord, seq_id)) * 7 + output_index * 13) % 800


class ScriptedWorker:
    def __init__(
        self,
        nats_url: str,
        namespace: str,
        worker_id: str = "w1",
        num_kv_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 128,
        heartbeat_interval_s: float = 0.1,
        step_delay_s: float = 0.0,
        register_with: str | None = None,
        confirm_spills: bool = False,
        password: str | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.namespace = namespace
        self.info = worker_info(num_kv_blocks, block_size, max_model_len, worker_id, "scripted")
        self.heartbeat_interval_s = heartbeat_interval_s
        # A scheduler id: register with that one (sched.<id>.register), else with
        # whichever of the queue group answers.
        self.register_subject = (
            subjects.sched_register(register_with) if register_with else subjects.WORKER_REGISTER
        )
        self.step_delay_s = step_delay_s
        self.confirm_spills = confirm_spills
        self.password = password  # of the `worker` user, on a server with users
        self.plans: list[StepPlan] = []
        self.owner = ""  # the scheduler that took the registration
        self.fail_next_step = False
        self.gate = asyncio.Event()  # steps wait for it; set = answer at once
        self.gate.set()
        self._silent = False
        self.num_steps = 0  # steps answered (its heartbeats say how many)
        self._released = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.bus: Bus | None = None

    async def start(self) -> None:
        self.bus = await Bus.connect(
            self.nats_url,
            self.namespace,
            f"worker-{self.info.worker_id}",
            service="worker" if self.password else None,
            user="worker" if self.password else None,
            password=self.password,
        )
        await self.bus.serve(subjects.worker_step(self.info.worker_id), StepPlan, self._on_step)
        # The discover body is empty: no model to validate against.
        await self.bus.nc.subscribe(
            self.bus.subject(subjects.WORKER_DISCOVER), cb=self._on_discover
        )
        await self.register()
        self._tasks.append(asyncio.create_task(self._heartbeat()))

    async def register(self) -> None:
        assert self.bus is not None
        while True:
            try:
                reply = await self.bus.request(self.register_subject, self.info, RegisterReply, 3.0)
                self.owner = reply.scheduler_id
                return
            except BusError:
                await asyncio.sleep(0.05)

    def fall_silent(self) -> None:
        """No more heartbeats, and steps are never answered: a hung or dead worker."""
        self._silent = True

    async def stop(self) -> None:
        self._released.set()
        for task in self._tasks:
            task.cancel()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.nc.close()

    async def _on_discover(self, raw) -> None:
        if not self._silent:
            self._tasks.append(asyncio.create_task(self.register()))

    async def _heartbeat(self) -> None:
        assert self.bus is not None
        while not self._silent:
            beat = Heartbeat(info=self.info, scheduler_id=self.owner, num_steps=self.num_steps)
            await self.bus.publish(subjects.WORKER_HEARTBEAT, beat)
            await asyncio.sleep(self.heartbeat_interval_s)

    async def _on_step(self, plan: StepPlan, ctx, raw) -> StepResult | None:
        if not (plan.finished_seq_ids or plan.new_seqs or plan.updated_seqs or plan.rows):
            return StepResult(step_id=plan.step_id)  # the registration probe
        self.plans.append(plan)
        await self.gate.wait()
        if self._silent:
            await self._released.wait()
            return None
        if self.step_delay_s:
            await asyncio.sleep(self.step_delay_s)
        if self.fail_next_step:
            self.fail_next_step = False
            return StepResult(
                step_id=plan.step_id, error=ErrorInfo(status=500, message="scripted failure")
            )
        rows = [
            RowResult(seq_id=r.seq_id, token_id=scripted_token(r.seq_id, r.output_index))
            for r in plan.rows
            if r.sample
        ]
        self.num_steps += 1
        spills = [
            SpillOutcome(seq_id=s.seq_id, spill_id=s.spill_id, ok=True)
            for s in plan.spills
            if self.confirm_spills
        ]
        return StepResult(step_id=plan.step_id, rows=rows, forward_s=0.001, spills=spills)
