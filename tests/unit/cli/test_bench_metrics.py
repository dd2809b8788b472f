"""The bench's figures from hand-built records, its tables, and the matmul bound."""

from __future__ import annotations

import dataclasses
import json

import pytest

from spillway.services.cli.bench.command import (
    bound_tokens_per_s,
    flops_per_request,
    work_of_request,
)
from spillway.services.cli.bench.machine import read_gbps
from spillway.services.cli.bench.metrics import RequestRecord, Stats, summarise
from spillway.services.cli.bench.peers import PeerResult, agreement
from spillway.services.cli.bench.report import comparison_table, summary_table, write_json
from spillway.services.cli.bench.workload import BenchRequest
from spillway.shared.model_config import ModelConfig


def _record(index, sent, chunks, out_tokens, prompt=10, error=None):
    return RequestRecord(
        index=index,
        sent_s=sent,
        chunk_s=list(chunks),
        end_s=(chunks[-1] if chunks else sent) + 0.01,
        prompt_tokens=prompt,
        output_tokens=out_tokens,
        error=error,
    )


def test_summary_of_hand_built_records():
    records = [
        _record(0, 0.0, [0.5, 0.6, 0.8], 3),  # TTFT 0.5, ITL 0.1 0.2, TPOT 0.15, E2E 0.8
        _record(1, 0.0, [1.0, 1.5], 2),  # TTFT 1.0, ITL 0.5, TPOT 0.5, E2E 1.5
        _record(2, 0.2, [], 0, error="HTTP 503: busy"),
    ]
    s = summarise(records)
    assert (s.completed, s.failed) == (2, 1)
    assert s.duration_s == pytest.approx(1.51)
    assert (s.input_tokens, s.output_tokens) == (20, 5)
    assert s.output_throughput == pytest.approx(5 / 1.51)
    assert s.request_throughput == pytest.approx(2 / 1.51)
    assert s.ttft_ms.mean == pytest.approx(750.0) and s.ttft_ms.median == pytest.approx(750.0)
    assert s.itl_ms.median == pytest.approx(200.0) and s.itl_ms.mean == pytest.approx(800 / 3)
    assert s.tpot_ms.mean == pytest.approx(325.0)
    assert s.e2el_ms.p99 == pytest.approx(1500.0 - 0.01 * 700, rel=1e-3)
    assert s.errors == ("HTTP 503: busy",)


def test_no_successful_request_gives_no_latency_figures():
    s = summarise([_record(0, 0.0, [], 0, error="boom")])
    assert s.completed == 0 and s.ttft_ms is None and s.output_throughput == 0.0
    assert "error: boom" in summary_table("t", s)


def test_tables_and_json_carry_the_figures(tmp_path):
    s = summarise([_record(0, 0.0, [0.5, 0.6], 2)])
    table = summary_table("spillway", s)
    assert "output token throughput (tok/s)" in table and "time to first token" in table
    peers = [
        PeerResult("transformers", output_tokens=2, duration_s=1.2, note="static"),
        PeerResult("llama.cpp", error="exit code 1: no model"),
    ]
    text = comparison_table("ours", s, peers, {"transformers": (1, 1.0)}, bound_tok_s=10.0)
    lines = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert f"{2 / 1.2:.1f}" in lines["transformers"] and "identical outputs 1/1" in text
    ratio = s.output_throughput / (2 / 1.2)
    assert f"{ratio:.2f}" in lines["transformers"]
    assert "failed: exit code 1" in lines["llama.cpp"]
    path = tmp_path / "out" / "bench.json"
    write_json(path, {"summary": s, "stats": Stats(1.0, 2.0, 3.0), "file": tmp_path})
    data = json.loads(path.read_text())
    assert data["summary"]["completed"] == 1 and data["stats"]["p99"] == 3.0
    assert data["file"] == str(tmp_path)


def test_agreement_counts_identical_outputs_and_common_prefixes():
    assert agreement(["abc", "abcd"], ["abc", "abXY"]) == (1, pytest.approx((1 + 0.5) / 2))


CONFIG = ModelConfig(
    architecture="llama", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1,
    head_dim=4, intermediate_size=16, vocab_size=32, context_length=64, rope_theta=1e4,
    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(),
)  # fmt: skip


def test_flops_count_projections_lm_head_and_attention():
    per_layer = 8 * (2 + 2) * 4 + 2 * 4 * 8 + 3 * 8 * 16  # qkv + o + gate/up/down
    tokens = 3 + 2 - 1
    want = 2 * 2 * per_layer * tokens + 2 * 32 * 8 * 2 + 4 * 2 * 2 * 4 * (tokens * 5 / 2)
    assert flops_per_request(CONFIG, 3, 2) == pytest.approx(want)
    reqs = [BenchRequest(0, (1, 2, 3), 2, 0.0)] * 2
    assert bound_tokens_per_s(CONFIG, reqs, gflops=1.0) == pytest.approx(4 / (2 * want / 1e9))
    # A wider model is slower at the same rate.
    wide = dataclasses.replace(CONFIG, intermediate_size=64)
    assert bound_tokens_per_s(wide, reqs, 1.0) < bound_tokens_per_s(CONFIG, reqs, 1.0)


def test_the_bound_counts_attentions_key_and_value_reads():
    w = work_of_request(CONFIG, 3, 2)
    # Prompt's 3 positions read once, then position 3 (the one token fed back) reads 4 keys.
    per_token = 2 * 2 * 1 * 4 * 4  # k and v, 2 layers, 1 KV head, 4 wide, float32
    assert w.attention_bytes == per_token * (3 + 4)
    assert w.flops == pytest.approx(flops_per_request(CONFIG, 3, 2))
    reqs = [BenchRequest(0, (1, 2, 3), 2, 0.0)] * 2
    arithmetic = bound_tokens_per_s(CONFIG, reqs, gflops=1.0)
    # Memory fast enough: the arithmetic decides; slow: the reads add to the products' time.
    assert bound_tokens_per_s(CONFIG, reqs, 1.0, gbps=1e6) == pytest.approx(arithmetic)
    slow = 2 * w.attention_bytes / 1e7  # seconds at 0.01 GB/s
    assert slow > 2 * w.attention_flops / 1e9
    want = 4 / (2 * w.matmul_flops / 1e9 + slow)
    assert bound_tokens_per_s(CONFIG, reqs, 1.0, gbps=0.01) == pytest.approx(want)
    assert want < arithmetic


def test_read_bandwidth_is_a_positive_rate():
    assert 0.1 < read_gbps(megabytes=16, rounds=2) < 1e4
