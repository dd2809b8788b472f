"""The worker's CPU choices: dtype auto, thread count, int8 projections and the perplexity
that measures what they cost, step phase timings."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kernels.linear import FORMS
from kernels.ops import TorchOps
from services.worker import loader
from services.worker.model import LlamaModel, configure_threads
from services.worker.quality import perplexity
from shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow
from tests.unit.worker.tiny_llama import TINY_VOCAB, tiny_runner

TEXT = [random.Random(5).randrange(3, TINY_VOCAB) for _ in range(70)]


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    return tiny_runner(tiny_llama_dir, kv_blocks=16)


def test_perplexity_equals_transformers_on_the_same_weights(runner, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([TEXT])
    with torch.inference_mode():
        want = math.exp(float(hf(ids, labels=ids).loss))
    # chunks of 16 cross block boundaries and read earlier chunks back from the cache
    got = perplexity(runner.model, TEXT, chunk=16)
    assert got == pytest.approx(want, rel=1e-4)


def test_int8_projections_change_outputs_a_little(runner):
    exact = perplexity(runner.model, TEXT)
    m = runner.model
    quantized = LlamaModel(m.config, m.weights, TorchOps(quantize="int8"))
    got = perplexity(quantized, TEXT)
    assert got != exact and abs(got / exact - 1) < 0.25
    with pytest.raises(ValueError, match="perplexity needs at least two tokens"):
        perplexity(m, TEXT[:1])


def test_warm_up_makes_the_int8_many_row_forms_too(runner):
    m = runner.model
    ops = TorchOps(quantize="int8")
    LlamaModel(m.config, m.weights, ops).warm_up()
    projections = 4 * m.config.num_layers + 1  # qkv, o, gate_up, down; the lm_head
    linear = ops._linear
    # the native int8 product's packed weights where it is built, else fbgemm's
    made = len(linear._rows) if linear.matmul is not None else len(linear)
    assert made == projections


def test_warm_up_keeps_one_many_row_form_per_exact_projection(runner):
    m = runner.model
    ops = TorchOps()
    LlamaModel(m.config, m.weights, ops).warm_up()
    w = m.weights
    projections = [p for x in w.layers for p in (x.qkv, x.o, x.gate_up, x.down)] + [w.lm_head]
    linear = ops._linear
    # each weight packed for oneDNN or transposed for MKL, as the timed pass chose, not both
    assert len(linear) == (len(projections) if linear.enabled else 0)
    assert {ops.many_row_form(p) for p in projections} <= set(FORMS)
    g = torch.Generator().manual_seed(3)
    for p in projections[:4]:  # whichever form: x W^T up to float32 summation order
        x = torch.randn(16, p.shape[1], generator=g)
        want = x.double() @ p.double().T
        torch.testing.assert_close(ops.linear(x, p).double(), want, rtol=1e-5, atol=1e-4)


def test_a_step_reports_its_phases(runner):
    runner.execute(StepPlan(step_id=0, finished_seq_ids=list(runner.sequences)))
    new = NewSequence(seq_id="p", sampling=SamplingParams(temperature=0.0), block_ids=[0, 1])
    row = StepRow(seq_id="p", token_ids=TEXT[:20], start_pos=0, sample=True)
    result = runner.execute(StepPlan(step_id=1, new_seqs=[new], rows=[row]))
    assert result.error is None and len(result.rows) == 1
    assert result.prepare_s is not None and result.prepare_s >= 0
    assert result.sample_s is not None and 0 <= result.sample_s <= result.forward_s


def test_dtype_auto_is_float32_unless_asked_for_the_fastest_with_bf16_units(monkeypatch):
    cpu = torch.device("cpu")
    speed = {torch.float32: 1.0, torch.bfloat16: 0.1}  # seconds: bfloat16 looks 10x faster
    monkeypatch.setattr(loader, "time_matmul", lambda dtype: speed[dtype])
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"avx2"}))
    assert loader.resolve_dtype("auto", cpu) == torch.float32  # the exact mode
    assert loader.resolve_dtype("auto", cpu, "fastest") == torch.float32  # emulated bf16
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert loader.resolve_dtype("auto", cpu, "fastest") == torch.bfloat16
    speed[torch.bfloat16] = 0.95  # units, but not worth it
    assert loader.resolve_dtype("auto", cpu, "fastest") == torch.float32
    assert loader.resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert loader.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_thread_count_is_set_and_defaults_to_every_available_core():
    before = torch.get_num_threads()
    try:
        assert configure_threads(torch.device("cpu"), 1) == 1 == torch.get_num_threads()
        n = configure_threads(torch.device("cpu"))
        assert n >= 1 and torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)
