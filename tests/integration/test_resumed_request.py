"""A request resumed on a fresh scheduler and worker (its first scheduler died) from its
prompt plus the tokens it already produced continues with exactly the tokens an
undisturbed run produces next: seeded sampling draws at the same output positions, and
penalties count the resumed tokens as output. The real scheduler core drives the real
model runner, in one process."""

from __future__ import annotations

import pytest

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.worker.info import worker_info
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import RequestDelta, SamplingParams, SubmitRequest
from tests.unit.worker.tiny_llama import save_tiny_llama, tiny_runner

PROMPT = [(11 * j) % 200 + 3 for j in range(23)]
NEW_TOKENS = 48
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=1234),
    # Frequency and presence count output tokens only, repetition prompt and output:
    # wrong if the resumed tokens were taken for prompt.
    "penalties": SamplingParams(
        temperature=0.8,
        seed=99,
        frequency_penalty=1.5,
        presence_penalty=1.0,
        repetition_penalty=1.3,
    ),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


def _run(model_dir, sampling: SamplingParams, resumed: list[int]) -> list[RequestDelta]:
    """Every delta of one request on a fresh scheduler core and runner."""
    runner = tiny_runner(model_dir, kv_blocks=32)
    core = SchedulerCore(FakeClock(), SchedulerConfig(max_batch=4, max_num_batched_tokens=16))
    core.attach_worker(worker_info("w", "tiny", runner))
    error = core.add_request(
        SubmitRequest(
            request_id="r",
            gateway_id="g",
            prompt_token_ids=PROMPT,
            sampling=sampling,
            max_tokens=NEW_TOKENS,
            ignore_eos=True,
            output_token_ids=resumed,
        )
    )
    assert error is None
    deltas: list[RequestDelta] = []
    for _ in range(500):
        plan = core.schedule()
        if plan is not None:
            deltas += core.update_from_output(plan, runner.execute(plan))
        deltas += core.end_tick()
        if any(d.finish_reason is not None for d in deltas):
            break
    assert core.num_live == 0
    return deltas


def _tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_a_resumed_request_continues_as_if_undisturbed(model_dir, name):
    sampling = SAMPLINGS[name]
    whole = _tokens(_run(model_dir, sampling, []))
    assert len(whole) == NEW_TOKENS
    for cut in (1, 17, NEW_TOKENS - 1):
        deltas = _run(model_dir, sampling, whole[:cut])
        assert whole[:cut] + _tokens(deltas) == whole, f"cut at {cut}"
        # Only the new tokens come back; the prompt reported is the original one.
        assert len(_tokens(deltas)) == NEW_TOKENS - cut
        assert deltas[0].num_prompt_tokens == len(PROMPT)
        assert deltas[-1].finish_reason == "length"


def test_a_resumed_request_with_nothing_left_is_refused(model_dir):
    runner = tiny_runner(model_dir, kv_blocks=8)
    core = SchedulerCore(FakeClock(), SchedulerConfig())
    core.attach_worker(worker_info("w", "tiny", runner))
    request = SubmitRequest(
        request_id="r",
        gateway_id="g",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(),
        max_tokens=3,
        output_token_ids=[5, 6, 7],
    )
    error = core.add_request(request)
    assert error is not None and error.status == 400
    bad = request.model_copy(update={"max_tokens": 10, "output_token_ids": [10**9]})
    error = core.add_request(bad)
    assert error is not None and error.status == 400 and "output token ids" in error.message
