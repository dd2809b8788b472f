"""The decode-step benchmark section on the CPU at tiny sizes: our step agrees with
transformers running the same synthetic weights, and a configuration too big for the device
is reported as skipped."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import bench.kernels
from bench import decode_step
from bench.decode_step import SMALL_CONFIG, StepSetup, kv_bytes, weight_bytes_read
from spillway.kernels.cpu.ops import CpuOps

TINY = dataclasses.replace(
    SMALL_CONFIG, num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
    intermediate_size=256, vocab_size=512,
)  # fmt: skip


@pytest.fixture
def one_call_timer(monkeypatch):
    """Each timing runs its function once (speed is not what this test checks)."""

    def once(fn, *args, **kwargs) -> float:
        fn()
        return 1.0

    monkeypatch.setattr(bench.kernels, "_time_cpu", once)


def test_the_section_checks_our_step_against_transformers(monkeypatch, one_call_timer):
    cases = [(3, 40), (2, 70), (64, 1024)]
    setup = StepSetup("tiny", TINY, torch.float32, cases, 1e-3)
    monkeypatch.setattr(decode_step, "setup_for", lambda device: setup)
    # A device whose memory holds the first two configurations but not the third.
    big = kv_bytes(TINY, torch.float32, 64, 1024)
    monkeypatch.setattr(
        decode_step, "device_memory", lambda device: decode_step.HEADROOM_BYTES + big - 1
    )
    rows = decode_step.bench_decode_step(torch.device("cpu"), CpuOps(), copy_gbps=None)
    assert [r.shape for r in rows] == [
        "tiny B=3 ctx=40 float32 eager",
        "tiny B=2 ctx=70 float32 eager",
        "tiny B=64 ctx=1024 float32",
    ]
    for row in rows[:2]:
        assert row.ok and row.extra["finite"]
        assert "transformers_us" in row.extra, row.extra.get("note")
        assert row.rel_error < 1e-4
        assert row.extra["argmax_agreement"] == 1.0
    skipped = rows[2]
    assert skipped.ok and skipped.time_us == 0.0
    assert skipped.extra["note"].startswith("skipped: needs")


def test_the_floor_counts_every_weight_but_the_unread_embedding_rows():
    weights = decode_step.synthetic_weights(TINY, torch.device("cpu"), torch.float32)
    embed_bytes = TINY.vocab_size * TINY.hidden_size * 4
    assert weight_bytes_read(weights, 8) == weights.num_bytes() - embed_bytes + 8 * 128 * 4
    per_token = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 4
    assert kv_bytes(TINY, torch.float32, 3, 100) == 300 * per_token
