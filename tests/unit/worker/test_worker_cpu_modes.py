"""The worker's CPU choices: dtype auto, thread count, int8 projections and the perplexity
that measures what they cost, step phase timings."""

from __future__ import annotations

import math
import random

import pytest
import torch

from spillway.kernels.cpu.linear import FORMS
from spillway.kernels.cpu.ops import CpuOps
from spillway.services.worker import loader
from spillway.services.worker.loading import load_runner
from spillway.services.worker.models.llama import LlamaModel
from spillway.services.worker.quality import perplexity
from spillway.services.worker.threads import configure_threads
from spillway.shared.config import load_settings
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow
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
    quantized = LlamaModel(m.config, m.weights, CpuOps(quantize="int8"))
    got = perplexity(quantized, TEXT)
    assert got != exact and abs(got / exact - 1) < 0.25
    with pytest.raises(ValueError, match="perplexity needs at least two tokens"):
        perplexity(m, TEXT[:1])


def test_warm_up_rows_are_more_than_any_few_row_kernel_takes():
    """Else the warm-up's many-row pass runs a few-row kernel and the first prefill packs."""
    from spillway.kernels.cpu import matvec
    from spillway.services.worker.models.llama import WARM_UP_ROWS

    assert max(matvec.MAX_ROWS, matvec.MAX_BLOCK_ROWS) < WARM_UP_ROWS


def test_warm_up_makes_the_int8_many_row_forms_too(runner):
    m = runner.model
    ops = CpuOps(quantize="int8")
    LlamaModel(m.config, m.weights, ops).warm_up()
    projections = 4 * m.config.num_layers + 1  # qkv, o, gate_up, down; the lm_head
    linear = ops._linear
    # the native int8 product's packed weights where it is built, else fbgemm's
    made = len(linear._rows) if linear.matmul is not None else len(linear)
    assert made == projections


def test_warm_up_keeps_one_many_row_form_per_exact_projection(runner):
    m = runner.model
    ops = CpuOps()
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


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_only_the_sampling_rows_reach_the_lm_head(tiny_llama_dir, monkeypatch, quantize):
    settings = load_settings(
        model=str(tiny_llama_dir), kv_blocks=16, device="cpu", dtype="float32", quantize=quantize
    )
    runner, _ = load_runner(settings)
    ops, head = runner.model.ops, runner.model.weights.lm_head
    linear, decode_layers = ops.linear, ops.decode_layers
    head_rows: list[int] = []
    at_once: list[bool] = []

    def counting_linear(x, weight, bias=None):
        if weight is head:
            head_rows.append(x.shape[0])
        return linear(x, weight, bias)

    def watched_decode_layers(*args, **kwargs):
        out = decode_layers(*args, **kwargs)
        at_once.append(out is not None)
        return out

    monkeypatch.setattr(ops, "linear", counting_linear)
    monkeypatch.setattr(ops, "decode_layers", watched_decode_layers)
    greedy = SamplingParams(temperature=0.0)
    steps = [
        StepPlan(  # a prompt's first chunk (no sampling) beside a whole short prompt
            step_id=1,
            new_seqs=[
                NewSequence(seq_id="a", sampling=greedy, block_ids=[0, 1]),
                NewSequence(seq_id="b", sampling=greedy, block_ids=[2]),
            ],
            rows=[
                StepRow(seq_id="a", token_ids=TEXT[:12], start_pos=0, sample=False),
                StepRow(seq_id="b", token_ids=TEXT[30:35], start_pos=0, sample=True),
            ],
        ),
        StepPlan(  # the prompt's last chunk and a decode row: the layer loop
            step_id=2,
            rows=[
                StepRow(seq_id="a", token_ids=TEXT[12:20], start_pos=12, sample=True),
                StepRow(seq_id="b", token_ids=[], start_pos=5, feed_last=True, sample=True),
            ],
        ),
        StepPlan(  # decode rows only, one of them not sampling: the one-call decode loop
            step_id=3,
            rows=[
                StepRow(seq_id="a", token_ids=[], start_pos=20, feed_last=True, sample=True),
                StepRow(seq_id="b", token_ids=[], start_pos=6, feed_last=True, sample=False),
            ],
        ),
    ]
    results = [runner.execute(plan) for plan in steps]
    assert all(r.error is None for r in results)
    assert [len(r.rows) for r in results] == [1, 2, 1]
    assert head_rows == [1, 2, 1]
    assert at_once[-1] == (ops._decode_layers is not None)


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
