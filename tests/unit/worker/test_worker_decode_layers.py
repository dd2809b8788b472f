"""The one-call layer loop of few-row decode steps (`kernels.cpu.decode_layers`) against the
layer-by-layer loop over the same native kernels: the same logits and caches to the bit."""

from __future__ import annotations

import copy

import pytest
import torch

from spillway.kernels.cpu import matvec
from spillway.kernels.cpu.decode_layers import FEW_ROWS_AT_MOST, Geometry
from spillway.kernels.cpu.matvec import BlockWeight
from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.cpu.quantized_weight import QuantizedWeight
from spillway.services.worker.kv_cache import KVCache
from spillway.services.worker.models.llama import LlamaModel
from spillway.services.worker.runner import ModelRunner
from spillway.services.worker.synthetic import synthetic_weights
from spillway.shared.model_config import ModelConfig
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow

CONFIG = ModelConfig(
    architecture="llama",
    num_layers=3,
    hidden_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=192,
    vocab_size=256,
    context_length=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_ids=(),
)
BLOCK = 16


@pytest.fixture(scope="module")
def weights():
    w = synthetic_weights(CONFIG, torch.device("cpu"), torch.float32, seed=3, std=0.08)
    g = torch.Generator().manual_seed(4)
    for layer in w.layers:  # norms other than ones, so a swapped norm weight would show
        for norm in (layer.attn_norm, layer.ffn_norm):
            norm.copy_(torch.rand(norm.shape, generator=g) + 0.5)
    return w


@pytest.fixture(scope="module")
def block_weights(weights):
    """The same model with every projection rounded through GGUF's Q4_1 (the lm_head
    through Q8_0), as a GGUF file gives it: float32 weights and the blocks of their values."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    def through(t: torch.Tensor, kind: str) -> BlockWeight:
        qtype = GGMLQuantizationType[kind.upper()]
        raw = quants.quantize(t.numpy(), qtype)
        t.copy_(torch.from_numpy(np.array(quants.dequantize(raw, qtype), dtype=np.float32)))
        return BlockWeight(torch.from_numpy(np.array(raw)), kind, t.shape[1])

    w = copy.deepcopy(weights)
    w.lm_head = w.embed
    w.blocks = [(w.lm_head, through(w.lm_head, "q8_0"))]
    for layer in w.layers:
        for t in (layer.qkv, layer.o, layer.gate_up, layer.down):
            w.blocks.append((t, through(t, "q4_1")))
    return w


def _runner(
    weights,
    quantize: str,
    at_once: bool,
    kv_dtype: torch.dtype = torch.float32,
    together: bool | None = True,
    blocks: int = 24,
) -> ModelRunner:
    """A runner whose decode steps take the one-call loop (`at_once`; all threads in one
    region where `together`, else each projection in its own; None: chosen by timing) or
    the layer loop."""
    ops = CpuOps(quantize=quantize)
    if ops._decode_layers is None:
        pytest.skip("native kernels not built here (no compiler or no AVX2)")
    ops._decode_layers.together = together
    if not at_once:
        ops._decode_layers = None
    return ModelRunner(
        LlamaModel(CONFIG, weights, ops),
        KVCache(CONFIG, blocks, BLOCK, kv_dtype, torch.device("cpu")),
    )


def _steps(
    runner: ModelRunner, rows: int, logits_at: int = 5
) -> tuple[list[list[int]], torch.Tensor]:
    """A prompt per row (prefill: the layer-by-layer loop either way), then decode steps;
    the tokens each step sampled and decode step `logits_at`'s logits (the last's)."""
    seqs = [f"s{r}" for r in range(rows)]
    greedy = SamplingParams(temperature=0.0)
    new = [
        NewSequence(seq_id=s, sampling=greedy, block_ids=[2 * r, 2 * r + 1])
        for r, s in enumerate(seqs)
    ]
    prompts = [
        StepRow(
            seq_id=s, token_ids=[(13 * r + i) % 256 for i in range(9 + r)], start_pos=0, sample=True
        )
        for r, s in enumerate(seqs)
    ]
    first = runner.execute(StepPlan(step_id=0, new_seqs=new, rows=prompts))
    sampled = [[out.token_id for out in first.rows]]
    logits = None
    for step in range(1, 6):
        decode = [
            StepRow(seq_id=s, token_ids=[], start_pos=9 + r + step - 1, feed_last=True, sample=True)
            for r, s in enumerate(seqs)
        ]
        if step == logits_at:
            logits = runner.logits(runner.host_batch(decode)).clone()
        result = runner.execute(StepPlan(step_id=step, rows=decode))
        assert result.error is None
        sampled.append([out.token_id for out in result.rows])
    assert logits is not None
    return sampled, logits


@pytest.fixture
def two_threads():
    """Two math threads (CI's cores), so that a step in one region splits its projections."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("together", [True, False, None])
@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("rows", [1, matvec.MAX_ROWS])
def test_one_call_equals_the_layer_loop_to_the_bit(
    weights, quantize, rows, together, two_threads, monkeypatch
):
    """Each output computed as the layer loop computes it, whether the threads share each
    projection's rows in one region, work per projection, or the step chooses by timing."""
    loop = _runner(weights, quantize, at_once=False)
    once = _runner(weights, quantize, at_once=True, together=together)
    calls = []
    real = once.model.ops._decode_layers.run
    monkeypatch.setattr(
        once.model.ops._decode_layers, "run", lambda *a: calls.append(1) or real(*a)
    )
    want_tokens, want_logits = _steps(loop, rows)
    got_tokens, got_logits = _steps(once, rows)
    assert calls and len(calls) >= 5  # every decode step went through it
    assert got_tokens == want_tokens
    assert torch.equal(got_logits, want_logits)
    for a, b in zip(
        (*once.kv_cache.k, *once.kv_cache.v), (*loop.kv_cache.k, *loop.kv_cache.v), strict=True
    ):
        assert torch.equal(a, b)
    assert got_logits.std() > 0  # not a degenerate model


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_bf16_cache_one_call_equals_the_layer_loop_to_the_bit(weights, quantize, monkeypatch):
    loop = _runner(weights, quantize, at_once=False, kv_dtype=torch.bfloat16)
    once = _runner(weights, quantize, at_once=True, kv_dtype=torch.bfloat16)
    calls = []
    real = once.model.ops._decode_layers.run
    monkeypatch.setattr(
        once.model.ops._decode_layers, "run", lambda *a: calls.append(1) or real(*a)
    )
    want_tokens, want_logits = _steps(loop, matvec.MAX_ROWS)
    got_tokens, got_logits = _steps(once, matvec.MAX_ROWS)
    assert calls and len(calls) >= 5  # every decode step went through it
    assert got_tokens == want_tokens and torch.equal(got_logits, want_logits)
    for a, b in zip(
        (*once.kv_cache.k, *once.kv_cache.v), (*loop.kv_cache.k, *loop.kv_cache.v), strict=True
    ):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    # Against a float32 cache: close, yet not the same numbers (the cache did round).
    _, exact_logits = _steps(_runner(weights, quantize, at_once=True), matvec.MAX_ROWS)
    error = float((got_logits - exact_logits).norm() / exact_logits.norm())
    assert 0 < error < 5e-2, error  # int8 activations amplify a change: 2.5% seen


def test_the_model_files_blocks_give_the_float32_weights_steps(block_weights, monkeypatch):
    if not matvec.load().features & matvec.HAS_BLOCKS:
        pytest.skip("block kernel not built (needs AVX2, FMA and F16C)")
    dense = copy.copy(block_weights)
    dense.blocks = []  # the same float32 values, read as float32
    read = []
    real = matvec.MatvecKernels.linear_blocks
    monkeypatch.setattr(
        matvec.MatvecKernels, "linear_blocks", lambda *a: read.append(1) or real(*a)
    )
    want_tokens, want_logits = _steps(_runner(dense, "none", at_once=False), 2)
    assert not read
    loop_tokens, loop_logits = _steps(_runner(block_weights, "none", at_once=False), 2)
    assert read  # the layer loop read the blocks
    once = _runner(block_weights, "none", at_once=True)
    once_tokens, once_logits = _steps(once, 2)
    prepared = once.model.ops._decode_layers._prepared[False]
    for layer in prepared.array:  # the one-call loop reads every projection's blocks too
        assert all(getattr(layer, p).blocks for p in ("qkv", "o", "gate_up", "down"))
    assert once_tokens == loop_tokens and torch.equal(once_logits, loop_logits)
    assert loop_tokens == want_tokens
    # the same products in the same order: the float32 path's logits to the bit
    assert torch.equal(loop_logits, want_logits)


def _steps_at_once(
    runner: ModelRunner, rows: int, monkeypatch
) -> tuple[list[list[int]], torch.Tensor]:
    """`_steps`, every decode step checked to run as one native call (none declined)."""
    taken = []
    real = runner.model.ops._decode_layers.run
    monkeypatch.setattr(
        runner.model.ops._decode_layers, "run", lambda *a: taken.append(r := real(*a)) or r
    )
    out = _steps(runner, rows)
    assert len(taken) >= 5 and all(r is not None for r in taken)  # none declined
    return out


@pytest.fixture(scope="module")
def segment_weights(weights):
    """The model as a GGUF file keeps it in memory: every projection in its blocks, the
    fused q/k/v as segments of two formats (q and k in Q5_0, v in Q8_0, as llama.cpp
    writes a Q4_K_M file whose rows are too narrow for K-quants)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    def blocks(t: torch.Tensor, kind: str) -> QuantizedWeight:
        raw = quants.quantize(t.numpy(), GGMLQuantizationType[kind.upper()])
        return QuantizedWeight((BlockWeight(torch.from_numpy(np.array(raw)), kind, t.shape[1]),))

    w = copy.deepcopy(weights)
    q_width = CONFIG.num_heads * CONFIG.head_dim
    for layer in w.layers:
        q_and_k, v = layer.qkv[: q_width + q_width // 2], layer.qkv[q_width + q_width // 2 :]
        layer.qkv = QuantizedWeight.cat([blocks(q_and_k, "q5_0"), blocks(v, "q8_0")])
        layer.o, layer.gate_up = blocks(layer.o, "q4_0"), blocks(layer.gate_up, "q5_0")
        layer.down = blocks(layer.down, "q8_0")
    return w


@pytest.mark.parametrize("rows", [1, matvec.MAX_ROWS])
def test_a_projection_of_several_block_formats_goes_through_the_one_call_loop(
    segment_weights, rows, monkeypatch
):
    if not matvec.load().features & matvec.HAS_BLOCKS:
        pytest.skip("block kernel not built (needs AVX2, FMA and F16C)")
    once = _runner(segment_weights, "none", at_once=True)
    once_tokens, once_logits = _steps_at_once(once, rows, monkeypatch)
    for layer in once.model.ops._decode_layers._prepared[False].array:
        assert layer.qkv.num_segments == 2 and not layer.o.num_segments
    loop_tokens, loop_logits = _steps(_runner(segment_weights, "none", at_once=False), rows)
    assert once_tokens == loop_tokens and torch.equal(once_logits, loop_logits)
    assert once_logits.std() > 0


def test_more_rows_than_the_native_path_takes_loop_in_python(weights, monkeypatch):
    once = _runner(weights, "none", at_once=True)
    taken = []
    real = once.model.ops._decode_layers.run
    monkeypatch.setattr(
        once.model.ops._decode_layers, "run", lambda *a: taken.append(r := real(*a)) or r
    )
    _steps(once, matvec.MAX_ROWS + 1)
    assert taken and all(r is None for r in taken)  # asked, declined, and the loop served


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [FEW_ROWS_AT_MOST + 1, 16])
def test_many_int8_rows_go_through_the_one_call_loop_to_the_bit(
    weights, rows, kv_dtype, two_threads, monkeypatch
):
    """A decode step past the few-row kernels, in the int8 mode: every projection in the
    many-row kernel's packed form, the step through the one-call loop, the layer loop's
    tokens, logits and caches to the bit."""
    loop = _runner(weights, "int8", at_once=False, kv_dtype=kv_dtype, blocks=2 * rows)
    once = _runner(weights, "int8", at_once=True, kv_dtype=kv_dtype, blocks=2 * rows)
    if once.model.ops._linear.matmul is None:
        pytest.skip("the many-row int8 kernel is not built here (it needs AVX-512 VNNI)")
    taken = []
    real = once.model.ops._decode_layers.run
    monkeypatch.setattr(
        once.model.ops._decode_layers, "run", lambda *a: taken.append(r := real(*a)) or r
    )
    want_tokens, want_logits = _steps(loop, rows)
    got_tokens, got_logits = _steps(once, rows)
    assert len(taken) >= 5 and all(r is not None for r in taken)  # every decode step
    for layer in once.model.ops._decode_layers._prepared[True].array:
        assert all(getattr(layer, p).neg for p in ("qkv", "o", "gate_up", "down"))
    assert got_tokens == want_tokens
    assert torch.equal(got_logits, want_logits)
    for a, b in zip(
        (*once.kv_cache.k, *once.kv_cache.v), (*loop.kv_cache.k, *loop.kv_cache.v), strict=True
    ):
        assert torch.equal(a, b)
    assert got_logits.std() > 0


def test_many_float32_rows_loop_in_python(weights, monkeypatch):
    """The exact mode's many-row products (oneDNN, BLAS or the panels) have no native
    form here: past the few-row kernels its steps stay in the layer loop."""
    once = _runner(weights, "none", at_once=True, blocks=2 * (FEW_ROWS_AT_MOST + 1))
    taken = []
    real = once.model.ops._decode_layers.run
    monkeypatch.setattr(
        once.model.ops._decode_layers, "run", lambda *a: taken.append(r := real(*a)) or r
    )
    _steps(once, FEW_ROWS_AT_MOST + 1)
    assert taken and all(r is None for r in taken)


@pytest.mark.parametrize(("position", "slot", "match"), [(300, 0, "position"), (3, 10**6, "slot")])
def test_a_bad_position_or_slot_raises_as_the_layer_loop_does(weights, position, slot, match):
    runner = _runner(weights, "none", at_once=True)
    model, cache = runner.model, runner.kv_cache
    x = torch.randn(1, CONFIG.hidden_size)
    c = CONFIG
    geometry = Geometry(c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.head_dim**-0.5)
    with pytest.raises(IndexError, match=match), torch.inference_mode():
        model.cpu_ops.decode_layers(
            x, weights.layers, cache.k, cache.v, torch.tensor([position]), torch.tensor([slot]),
            torch.zeros(1, 2, dtype=torch.int32), torch.tensor([position + 1], dtype=torch.int32),
            model.cos, model.sin, geometry,
        )  # fmt: skip


def test_int8_reads_the_model_files_blocks_with_integer_products(block_weights, monkeypatch):
    """--quantize int8 on a model with blocks: the one-call loop reads every projection's
    blocks with integer products, equal to the layer loop's calls to the bit."""
    if not matvec.load().features & matvec.HAS_BLOCKS_Q8:
        pytest.skip("integer block kernel not built (needs AVX2, FMA and F16C)")
    read = []
    real = matvec.MatvecKernels.linear_blocks_q8
    monkeypatch.setattr(
        matvec.MatvecKernels, "linear_blocks_q8", lambda *a: read.append(1) or real(*a)
    )
    loop_tokens, loop_logits = _steps(_runner(block_weights, "int8", at_once=False), 2)
    assert read  # the layer loop read the blocks (and the lm_head's)
    once = _runner(block_weights, "int8", at_once=True)
    once_tokens, once_logits = _steps(once, 2)
    prepared = once.model.ops._decode_layers._prepared[False]
    for layer in prepared.array:
        assert all(getattr(layer, p).integer for p in ("qkv", "o", "gate_up", "down"))
    assert once_tokens == loop_tokens and torch.equal(once_logits, loop_logits)


def _verify_logits(runner: ModelRunner, tokens: list[int], at_once: bool) -> torch.Tensor:
    """A prompt, then its continuation `tokens` either as one row with drafts (the last
    len(tokens) - 1 of them drafts: a verify step) or one token a step; the logits at each
    of those positions."""
    greedy = SamplingParams(temperature=0.0)
    new = [NewSequence(seq_id="s", sampling=greedy, block_ids=[0, 1, 2])]
    prompt = [(7 * i + 3) % 256 for i in range(11)]
    first = StepRow(seq_id="s", token_ids=prompt, start_pos=0, sample=True)
    assert runner.execute(StepPlan(step_id=0, new_seqs=new, rows=[first])).error is None
    if at_once:
        row = StepRow(seq_id="s", token_ids=tokens, start_pos=len(prompt), sample=True,
                      num_draft_tokens=len(tokens) - 1)  # fmt: skip
        return runner.logits(runner.host_batch([row])).clone()
    out = []
    for i, token in enumerate(tokens):
        row = StepRow(seq_id="s", token_ids=[token], start_pos=len(prompt) + i, sample=True)
        out.append(runner.logits(runner.host_batch([row])).clone())
    return torch.cat(out)


@pytest.mark.parametrize(
    ("quantize", "rows"),
    [("none", 2), ("none", matvec.MAX_ROWS + 1), ("none", matvec.MAX_BLOCK_ROWS),
     ("int8", matvec.MAX_ROWS), ("int8", matvec.MAX_BLOCK_ROWS)],
)  # fmt: skip
def test_a_verify_step_equals_one_token_steps_to_the_bit(
    block_weights, quantize, rows, monkeypatch
):
    """A speculative verify of several positions of one sequence runs as one native call
    (each weight block read once for all of them, up to MAX_BLOCK_ROWS in float32), and
    each position's logits are those of a step of that token alone: greedy outputs with
    drafts are the ones without."""
    feature = matvec.HAS_BLOCKS if quantize == "none" else matvec.HAS_BLOCKS_Q8
    if not matvec.load().features & feature:
        pytest.skip("block kernels not built (needs AVX2, FMA and F16C)")
    if rows > matvec.MAX_ROWS and quantize == "int8" and not _interleaved():
        pytest.skip("the interleaved integer kernels, which take 8 rows, need AVX2")
    tokens = [(5 * i + 17) % 256 for i in range(rows)]
    single = _verify_logits(_runner(block_weights, quantize, at_once=True), tokens, False)
    verify = _runner(block_weights, quantize, at_once=True)
    taken = []
    real = verify.model.ops._decode_layers.run
    monkeypatch.setattr(
        verify.model.ops._decode_layers, "run", lambda *a: taken.append(r := real(*a)) or r
    )
    got = _verify_logits(verify, tokens, True)
    assert taken[-1] is not None  # the verify went through the one-call loop
    assert got.shape == (rows, CONFIG.vocab_size)
    assert torch.equal(got, single)


def test_the_worker_says_how_many_positions_it_verifies_exactly(weights, block_weights):
    """What `WorkerInfo.max_verify_tokens` reports: the rows of the native one-call path
    (more in float32 over the file's blocks, whose kernel converts each block once)."""
    if not matvec.load().features & matvec.HAS_BLOCKS:
        pytest.skip("block kernels not built (needs AVX2, FMA and F16C)")
    assert _runner(block_weights, "none", True).max_verify_tokens == matvec.MAX_BLOCK_ROWS
    int8_rows = matvec.MAX_BLOCK_ROWS if _interleaved() else matvec.MAX_ROWS
    assert _runner(block_weights, "int8", True).max_verify_tokens == int8_rows
    assert _runner(weights, "none", True).max_verify_tokens == matvec.MAX_ROWS
    assert _runner(weights, "none", False).max_verify_tokens == 0  # no native path: no bound


@pytest.mark.parametrize("rows", [1, matvec.MAX_ROWS])
def test_a_q5_1_file_s_decode_steps_go_through_the_one_call_loop(tmp_path, rows, monkeypatch):
    """A GGUF file in Q5_1 (its projections kept in blocks: the fused kernel reads Q5_1):
    every decode step runs as one native call over the blocks, the layer loop's tokens
    and logits to the bit."""
    from gguf.constants import GGMLQuantizationType

    from spillway.services.worker.loading import load_runner
    from spillway.shared.config import load_settings
    from tests.gguf_files import write_tiny_llama

    if not matvec.load().features & matvec.HAS_BLOCKS:
        pytest.skip("block kernel not built (needs AVX2, FMA and F16C)")
    path = write_tiny_llama(tmp_path / "tiny-Q5_1.gguf", GGMLQuantizationType.Q5_1)
    settings = load_settings(model=str(path), kv_blocks=16, device="cpu", dtype="float32")
    once, loop = load_runner(settings)[0], load_runner(settings)[0]
    if once.model.ops._decode_layers is None:
        pytest.skip("native kernels not built here (no compiler or no AVX2)")
    loop.model.ops._decode_layers = None
    once_tokens, once_logits = _steps_at_once(once, rows, monkeypatch)
    for layer in once.model.ops._decode_layers._prepared[False].array:
        assert all(getattr(layer, p).blocks for p in ("qkv", "o", "gate_up", "down"))
    assert {p.kind for p in once.model.weights.layers[0].qkv.parts} == {"q5_1"}
    loop_tokens, loop_logits = _steps(loop, rows)
    assert once_tokens == loop_tokens and torch.equal(once_logits, loop_logits)


@pytest.mark.parametrize("rows", [1, 2])
def test_int8_reads_a_q4_k_m_file_s_every_type_with_integer_products(tmp_path, rows, monkeypatch):
    """--quantize int8 on a file of a llama.cpp Q4_K_M's types: every decode step one native
    call reading every projection with integer products (layer 0's q/k/v as a Q5_0 and a
    Q8_0 segment), the layer loop's tokens and logits to the bit, and close to the exact
    mode's logits."""
    from spillway.services.worker.loading import load_runner
    from spillway.shared.config import load_settings
    from tests.gguf_files import Q4_K_M_NARROW, write_tiny_llama

    if not matvec.load().features & matvec.HAS_BLOCKS_Q8:
        pytest.skip("integer block kernel not built (needs AVX2, FMA and F16C)")
    path = write_tiny_llama(tmp_path / "tiny-Q4_K_M.gguf", Q4_K_M_NARROW)
    settings = {"model": str(path), "kv_blocks": 16, "device": "cpu", "dtype": "float32"}
    int8 = load_settings(**settings, quantize="int8")
    once, loop = load_runner(int8)[0], load_runner(int8)[0]
    if once.model.ops._decode_layers is None:
        pytest.skip("native kernels not built here (no compiler or no AVX2)")
    loop.model.ops._decode_layers = None
    once_tokens, once_logits = _steps_at_once(once, rows, monkeypatch)
    layers = once.model.ops._decode_layers._prepared[False].array
    for layer in layers:
        assert all(getattr(layer, p).integer for p in ("qkv", "o", "gate_up", "down"))
    assert [layer.qkv.num_segments for layer in layers] == [2, 0]  # layer 1's: all Q5_0
    loop_tokens, loop_logits = _steps(loop, rows)
    assert once_tokens == loop_tokens and torch.equal(once_logits, loop_logits)
    # The first decode step (after the same prompt and sampled token: a random model's
    # near ties part the two modes' tokens later).
    exact_tokens, exact_logits = _steps(load_runner(load_settings(**settings))[0], rows, 1)
    _, int8_logits = _steps(load_runner(int8)[0], rows, 1)
    assert exact_tokens[0] == once_tokens[0]
    error = float((int8_logits - exact_logits).norm() / exact_logits.norm())
    assert 0 < error < 5e-2, error


def _interleaved() -> bool:
    """Whether `--quantize int8` reads Q4_1 and Q8_0 blocks interleaved (16 rows a group with
    AVX-512 VNNI, 8 with AVX2 or AVX-VNNI)."""
    return bool(matvec.load().features & (matvec.HAS_BLOCKS_X16 | matvec.HAS_BLOCKS_X8))


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_thread_held_inside_a_chunk_has_it_computed_by_another_to_the_bit(
    weights, quantize, two_threads
):
    """A thread taken off its core while it computes a chunk (here: put to sleep, as the
    services waking on every token do to it) does not hold the step: the other computes
    the chunk too and commits the first copy done; the late one is thrown away."""
    loop = _runner(weights, quantize, at_once=False)
    once = _runner(weights, quantize, at_once=True, together=True)
    layers = once.model.ops._decode_layers
    want_tokens, want_logits = _steps(loop, 1)
    before = layers.stolen()
    for phase in (1, 3, 5, 7, 8 + 3):  # every projection of layer 0, layer 1's o
        once.forget_all()
        layers.stall_once(phase, 50_000)
        got_tokens, got_logits = _steps(once, 1)  # a fresh prompt and 5 decode steps
        assert got_tokens == want_tokens, phase
        assert torch.equal(got_logits, want_logits), phase
    assert layers.stolen() - before >= 5
