"""Plans reach the step thread in the order they came, also across a registration.

A scheduler that adopts a worker may send its first plans before its registration reply
has reached the worker. The first plan then waits for the reply; the worker records its
new owner and forgets the sequences of the old one on the step thread. A plan arriving
in that moment is the new owner's too, and must not overtake the one still waiting: it
would run a decode before the prefill it continues ("row for unknown sequence").

Real NATS; the model is a recording double (the order, not the arithmetic, is tested).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

from spillway.services.worker.service import WorkerService
from spillway.shared import subjects
from spillway.shared.bus import Bus
from spillway.shared.protocol import RegisterReply, StepPlan, StepResult, StepRow, WorkerInfo
from spillway.shared.telemetry import Telemetry
from tests.integration.worker.test_worker_service import _prefill_plan

WORKER = "w-order"
OWNER = "sched-new"


class RecordingRunner:
    """Records what the step thread ran; forget_all holds until released."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.sequences: dict[str, object] = {}
        self.forgetting = threading.Event()
        self.release = threading.Event()
        self.num_steps = 0
        self.last_forward_ns = (0, 0)
        self.last_kv_io: list = []
        self.experts = None

    def forget_all(self) -> None:
        self.forgetting.set()
        assert self.release.wait(30)
        self.ran.append("forget_all")
        self.sequences.clear()

    def execute(self, plan: StepPlan) -> StepResult:
        self.ran.append(f"step {plan.step_id}")
        for seq in plan.new_seqs:
            self.sequences[seq.seq_id] = seq
        unknown = [row.seq_id for row in plan.rows if row.seq_id not in self.sequences]
        if unknown:
            raise AssertionError(f"row for unknown sequence {unknown}")
        self.num_steps += 1
        return StepResult(step_id=plan.step_id)


def _info() -> WorkerInfo:
    return WorkerInfo(
        worker_id=WORKER,
        model_id="double",
        num_kv_blocks=64,
        block_size=16,
        max_model_len=1024,
        vocab_size=256,
        eos_token_ids=[0],
        device="cpu",
        dtype="float32",
    )


async def test_a_plan_waiting_for_the_registration_is_not_overtaken(nats_url):
    namespace = f"order{uuid.uuid4().hex[:8]}"
    scheduler = await Bus.connect(nats_url, namespace, OWNER)
    scheduler.sender = OWNER  # the plans name it, as the scheduler's do
    worker_bus = await Bus.connect(nats_url, namespace, WORKER)
    registered = asyncio.Event()
    answer = asyncio.Event()

    async def on_register(info: WorkerInfo, ctx, raw) -> RegisterReply:
        registered.set()
        await answer.wait()  # the scheduler's first plan goes out before this reply
        return RegisterReply(scheduler_id=OWNER)

    await scheduler.serve(subjects.WORKER_REGISTER, WorkerInfo, on_register)
    runner = RecordingRunner()
    executor = ThreadPoolExecutor(max_workers=1)
    tel = Telemetry("worker", None)
    service = WorkerService(worker_bus, tel, runner, _info(), executor, 0.1)  # type: ignore[arg-type]
    stop = asyncio.Event()
    serving = asyncio.create_task(service.run(stop))
    step = subjects.worker_step(WORKER)
    try:
        await asyncio.wait_for(registered.wait(), 30)
        prefill = asyncio.create_task(
            scheduler.request(step, _prefill_plan(1, "seq-a"), StepResult, 30)
        )
        await asyncio.sleep(0.3)  # the prefill is at the worker, waiting for the reply
        assert runner.ran == [] and not prefill.done()
        answer.set()
        # The worker has recorded its new owner and forgets the old one's sequences.
        assert await asyncio.to_thread(runner.forgetting.wait, 30)
        decode = StepPlan(
            step_id=2, rows=[StepRow(seq_id="seq-a", token_ids=[5], start_pos=18, sample=True)]
        )
        decoding = asyncio.create_task(scheduler.request(step, decode, StepResult, 30))
        await asyncio.sleep(0.3)  # the decode is at the worker too
        runner.release.set()
        first, second = await asyncio.gather(prefill, decoding)
        assert first.error is None and second.error is None, (first.error, second.error)
        assert runner.ran == ["forget_all", "step 1", "step 2"]
    finally:
        runner.release.set()
        stop.set()
        await asyncio.wait_for(serving, 30)
        executor.shutdown(wait=False)
        tel.shutdown()
        await scheduler.close()
        await worker_bus.close()
