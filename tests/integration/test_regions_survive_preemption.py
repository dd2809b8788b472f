"""A sequence preempted inside a think block continues in it: the real scheduler core drives
the real runner with the scripted think model (tests/unit/worker/think_llama.py) under KV
pressure, and every sequence's tokens equal those of a run without pressure.

The sequences start inside a think block and sample at temperature 1 there (adaptive
sampling), greedily outside it: a sequence that came back in the wrong region would decode
greedily and leave the tokens it had without preemption. Victims are recomputed, or
spilled to a real Redis and swapped in (their KV read back, their region rebuilt from
their tokens).
"""

from __future__ import annotations

import pytest

from spillway.shared.protocol import RegionSampling, SamplingParams
from tests.integration.test_scheduler_drives_worker import NEW_TOKENS, _serve_all, memo_roomy
from tests.unit.worker.think_llama import THINK_END_ID, save_think_llama

THINKING = SamplingParams(
    temperature=0.0,
    initial_region="think",
    region_sampling={"think": RegionSampling(temperature=1.0)},
)


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory):
    return save_think_llama(tmp_path_factory.mktemp("think"))


@pytest.fixture(scope="module")
def roomy(think_dir):
    """The runs without pressure, shared by both modes (deterministic)."""
    return memo_roomy(think_dir)


@pytest.mark.parametrize("mode", ["recompute", "spill"])
def test_a_sequence_preempted_inside_a_think_block_continues_in_it(
    think_dir, roomy, redis_url, mode
):
    want, roomy_core = roomy(THINKING)
    spill_to = redis_url if mode == "spill" else None
    tight, tight_core = _serve_all(think_dir, kv_blocks=10, sampling=THINKING, spill_to=spill_to)
    assert roomy_core.stats.preemptions["recompute"] == 0
    assert tight_core.stats.preemptions[mode] > 0
    if mode == "spill":
        assert tight_core.stats.swap_ins == tight_core.stats.preemptions["spill"]
    # </think> never came, so every victim was inside its block.
    assert all(THINK_END_ID not in tokens for tokens in want.values())
    assert all(len(tokens) == NEW_TOKENS for tokens in want.values())
    assert tight == want
    # Were the region lost (plain), decoding would be greedy: other tokens.
    plain = THINKING.model_copy(update={"initial_region": "plain"})
    assert roomy(plain)[0] != want
