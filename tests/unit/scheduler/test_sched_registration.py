"""Registrations the scheduler refuses before they reach the core, and how the registry
treats a worker registering again, and heartbeats that name another scheduler."""

from __future__ import annotations

import pytest

from spillway.services.scheduler.registry import WorkerRegistry, registration_error
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import Heartbeat
from tests.unit.scheduler.harness import worker_info


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"num_kv_blocks": -3}, "num_kv_blocks"),
        ({"num_kv_blocks": 1 << 40}, "num_kv_blocks"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 12}, "block_size"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"eos_token_ids": [1000]}, "eos_token_ids"),
        ({"worker_id": ""}, "worker id"),
        ({"worker_id": "w.*"}, "worker id"),
        ({"worker_id": "x" * 65}, "worker id"),
        ({"model_id": ""}, "model_id"),
    ],
)
def test_registrations_that_would_break_the_scheduler_are_refused(change, problem):
    info = worker_info().model_copy(update=change)
    error = registration_error(info)
    assert error is not None and error.status == 400
    assert error.code == "invalid_registration" and problem in error.message


def test_a_sound_registration_passes():
    assert registration_error(worker_info()) is None


def test_the_same_process_registering_again_keeps_its_generation():
    registry = WorkerRegistry(FakeClock(), timeout_s=2.0, scheduler_id="s1")
    info = worker_info().model_copy(update={"boot_id": "boot-1"})
    first = registry.register(info).key
    assert registry.register(info).key == first  # a repeat: nothing to recompute
    restarted = info.model_copy(update={"boot_id": "boot-2"})
    assert registry.register(restarted).key != first  # a new process: KV cache lost


def test_heartbeats_count_only_for_the_scheduler_they_name():
    clock = FakeClock()
    registry = WorkerRegistry(clock, timeout_s=2.0, scheduler_id="s1")
    mine, theirs = worker_info(worker_id="w1"), worker_info(worker_id="w2")
    registry.register(mine)
    # A worker of another scheduler is never picked up from its heartbeats.
    assert not registry.heartbeat(Heartbeat(info=theirs, scheduler_id="s2"))
    assert not registry.heartbeat(Heartbeat(info=theirs, scheduler_id=""))
    assert registry.worker_ids() == ["w1"]
    # Ours keeps beating; one we had dropped comes back through its own heartbeat.
    clock.advance(1.5)
    assert not registry.heartbeat(Heartbeat(info=mine, scheduler_id="s1"))
    clock.advance(1.0)
    assert registry.expire() == []
    lost = worker_info(worker_id="w3")
    assert registry.heartbeat(Heartbeat(info=lost, scheduler_id="s1"))
    # A worker of ours that now names another scheduler has moved: forgotten.
    assert not registry.heartbeat(Heartbeat(info=mine, scheduler_id="s2"))
    assert registry.worker_ids() == ["w3"]


def test_after_our_own_outage_every_worker_counts_as_just_heard():
    clock = FakeClock()
    registry = WorkerRegistry(clock, timeout_s=2.0, scheduler_id="s1")
    registry.register(worker_info())
    clock.advance(10.0)
    registry.touch_all()
    assert registry.expire() == []
