"""The worker's whole decode step, measured: `python -m bench.decode_step` runs
the kernel benchmark (`bench.kernels`) with this step as its `decode_step` section.

A synthetic model (random weights made on the device) decodes one token for each of B rows
whose caches already hold `context - 1` tokens (random keys and values: attention costs the
same whatever they hold). Each step goes through `ModelRunner.execute`, host work, sampling
and the read-back included, replaying a CUDA graph on CUDA with the Triton backend.

Each row is set against two yardsticks:
  - the floor: the bytes a step must read (every weight once, except the embedding rows not
    looked up, and every row's KV cache) at the device's copy bandwidth;
  - transformers: `LlamaForCausalLM` over the very same weight tensors (shared, not copied)
    and the same cached keys and values in its default `DynamicCache`, one decode step of
    `model(input_ids[:, -1:], past_key_values=...)`; its logits also check ours.

In bfloat16 two implementations differ by their roundings, more so the deeper the model: on
CUDA the first case is also run by transformers over float32 copies of the same weights and
cache (the yardstick). Ours must be no further from it than 1.5x transformers' own bfloat16
step (plus 1e-3); then the check against transformers' bfloat16 logits allows 2.5x that
step's own distance from float32, where it exceeds the setup's tolerance.

On CUDA: Llama-3-8B shapes in bfloat16 at batch 1, 16, 64, 256 with 1k and 4k contexts;
a configuration that does not fit the device's memory is reported as skipped. On the CPU: a
small model in float32 at small sizes, so that the code path stays exercised.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.kernels import SECTIONS, Result, timer_for
from bench.kernels import main as bench_main
from spillway.kernels.ops import KernelOps
from spillway.services.worker.kv_cache import KVCache, blocks_needed
from spillway.services.worker.models.llama import LlamaModel
from spillway.services.worker.models.registry import load_model_config
from spillway.services.worker.runner import ModelRunner
from spillway.services.worker.synthetic import synthetic_weights
from spillway.services.worker.weights import ModelWeights
from spillway.shared.model_config import ModelConfig
from spillway.shared.model_files import resolve_model
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow

log = logging.getLogger(__name__)

STEP_FLOOR_TARGET = 1 / 1.5  # a batch-64 step should take at most 1.5x its floor
STEP_TARGET_BATCH = 64
TRANSFORMERS_SPEEDUP_TARGET = 3.0
BLOCK_SIZE = 16
GIB = 1 << 30
# Room for activations, logits, graph pools and the allocator's slack beside the caches.
HEADROOM_BYTES = 4 * GIB
GREEDY = SamplingParams(temperature=0.0)

SMALL_CONFIG = ModelConfig(
    architecture="llama",
    num_layers=4,
    hidden_size=512,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=1408,
    vocab_size=8192,
    context_length=2048,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_ids=(),
)


@dataclass(frozen=True)
class StepSetup:
    label: str
    config: ModelConfig
    dtype: torch.dtype
    cases: list[tuple[int, int]]  # (batch, context)
    tolerance: float  # relative logits error allowed against transformers


def setup_for(device: torch.device) -> StepSetup:
    if device.type == "cuda":
        config = load_model_config(resolve_model("synthetic:llama-3-8b"))
        cases = [(b, c) for c in (1024, 4096) for b in (1, 16, 64, 256)]
        return StepSetup("llama-3-8b", config, torch.bfloat16, cases, 5e-2)
    cases = [(1, 256), (4, 512)]
    return StepSetup("small-4L-512", SMALL_CONFIG, torch.float32, cases, 1e-3)


def kv_bytes(config: ModelConfig, dtype: torch.dtype, batch: int, context: int) -> int:
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize
    return batch * context * per_token


def weight_bytes_read(weights: ModelWeights, batch: int) -> int:
    """Bytes of weights one decode step must read: all of them, but of an untied embedding
    only the rows looked up."""
    total = weights.num_bytes()
    if weights.lm_head is weights.embed:
        return total
    row_bytes = weights.embed.stride(0) * weights.embed.element_size()
    return total - weights.embed.shape[0] * row_bytes + batch * row_bytes


def step_flops(config: ModelConfig, batch: int, context: int) -> int:
    c = config
    per_layer = (
        c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # qkv
        + c.num_heads * c.head_dim * c.hidden_size  # o
        + 3 * c.hidden_size * c.intermediate_size  # gate, up, down
    )
    matmul = 2 * batch * (c.num_layers * per_layer + c.vocab_size * c.hidden_size)
    attention = 4 * batch * context * c.num_heads * c.head_dim * c.num_layers
    return matmul + attention


def device_memory(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


@dataclass
class _Yardstick:
    """Distances from transformers in float32 over the same weights and cache, measured once."""

    ours: float  # our bfloat16 logits' relative distance
    theirs: float  # transformers' bfloat16 logits' relative distance

    @property
    def holds(self) -> bool:
        return self.ours <= 1.5 * self.theirs + 1e-3

    def tolerance(self, base: float) -> float:
        return max(base, 2.5 * self.theirs) if self.holds else base


@dataclass
class _Case:
    batch: int
    context: int
    fits: bool
    note: str = ""
    error: str = ""  # why the measurement failed, if it did
    extra: dict[str, Any] = field(default_factory=dict)
    # The measured step's tokens and our logits, for the float32 yardstick (not reported).
    tokens: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None


def bench_decode_step(device: torch.device, ops: KernelOps, copy_gbps: float | None) -> list:
    """Rows (`bench.kernels.Result`) for each configuration, skipped ones included."""
    timer = timer_for(device)
    setup = setup_for(device)
    config, dtype = setup.config, setup.dtype
    weights = synthetic_weights(config, device, dtype)
    total = device_memory(device)
    cases = []
    for batch, context in setup.cases:
        need = weights.num_bytes() + kv_bytes(config, dtype, batch, context) + HEADROOM_BYTES
        fits = total is None or need <= total
        note = "" if fits else f"skipped: needs {need / GIB:.0f} GiB, device has {total / GIB:.0f}"
        cases.append(_Case(batch, context, fits, note))
    fitting = [c for c in cases if c.fits]
    if fitting:
        _measure_all(fitting, setup, weights, ops, timer)
    results = [_result(Result, case, setup, weights, copy_gbps) for case in cases]
    del weights
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def _measure_all(
    cases: list[_Case],
    setup: StepSetup,
    weights: ModelWeights,
    ops: KernelOps,
    timer: Callable[[Callable[[], object]], float],
) -> None:
    """Fills in each case's figures, or its error: a failure costs its own row only, so the
    other rows (and the other sections) still report."""
    device = weights.device
    try:
        runner = _runner(setup.config, weights, ops, setup.dtype, device, cases)
    except Exception as e:
        log.exception("decode step: no runner")
        for case in cases:
            case.error = f"runner: {type(e).__name__}: {e}"
        return
    try:
        hf_model, hf_missing = _transformers_model(setup.config, weights, device)
    except Exception as e:
        log.exception("decode step: no transformers model")
        hf_model, hf_missing = None, f"{type(e).__name__}: {e}"
    yardstick: list[_Yardstick] = []
    for case in cases:
        try:
            _measure(runner, hf_model, hf_missing, case, setup, timer)
            if hf_model is not None and device.type == "cuda" and not yardstick:
                yardstick.append(_float32_yardstick(runner, hf_model, case, setup))
        except Exception as e:
            log.exception("decode step B=%d ctx=%d failed", case.batch, case.context)
            case.error = f"{type(e).__name__}: {e}"
    for case in cases:
        if yardstick:
            y = yardstick[0]
            case.extra.update(
                fp32_rel_error=y.ours,
                transformers_fp32_rel_error=y.theirs,
                tolerance=y.tolerance(setup.tolerance),
            )


def _float32_yardstick(
    runner: ModelRunner, hf_model: Any, case: _Case, setup: StepSetup
) -> _Yardstick:
    """transformers over float32 copies of the weights and cache, for this case's step."""
    weights32 = _float32_copy(runner.model.weights)
    hf32, missing = _transformers_model(setup.config, weights32, runner.model.device)
    if hf32 is None:
        raise RuntimeError(f"no float32 transformers model: {missing}")
    tokens, ours = case.tokens, case.logits
    assert ours is not None
    theirs, _ = _transformers_step(hf_model, runner.kv_cache, case, tokens, None)
    ref, _ = _transformers_step(hf32, runner.kv_cache, case, tokens, None, torch.float32)
    del hf32, weights32
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ref = ref.double()

    def distance(x: torch.Tensor) -> float:
        return float((x.double() - ref).norm() / ref.norm())

    return _Yardstick(ours=distance(ours), theirs=distance(theirs))


def _float32_copy(weights: ModelWeights) -> ModelWeights:
    """The same weights upcast to float32; a tensor shared twice (a tied head) stays shared."""
    seen: dict[int, torch.Tensor] = {}

    def up(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = value.data_ptr()
            if key not in seen:
                seen[key] = value.float() if value.is_floating_point() else value
            return seen[key]
        if isinstance(value, list):
            return [up(v) for v in value]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(
                value, **{f.name: up(getattr(value, f.name)) for f in dataclasses.fields(value)}
            )
        return value

    return up(weights)


def _runner(
    config: ModelConfig,
    weights: ModelWeights,
    ops: KernelOps,
    dtype: torch.dtype,
    device: torch.device,
    cases: list[_Case],
) -> ModelRunner:
    """A runner whose cache holds the largest case, filled with random keys and values, and
    on CUDA with Triton a decode graph for each batch size measured."""
    num_blocks = max(c.batch * blocks_needed(c.context, BLOCK_SIZE) for c in cases)
    kv_cache = KVCache(config, num_blocks, BLOCK_SIZE, dtype, device)
    generator = torch.Generator(device=device).manual_seed(1)
    for cache in (*kv_cache.k, *kv_cache.v):
        cache[:num_blocks].normal_(generator=generator)  # the pad block stays zeros
    runner = ModelRunner(LlamaModel(config, weights, ops), kv_cache)
    if device.type == "cuda" and ops.name == "triton":
        runner.capture_decode_graphs(sorted({c.batch for c in cases}))
    return runner


def _transformers_model(
    config: ModelConfig, weights: ModelWeights, device: torch.device
) -> tuple[Any, str]:
    """LlamaForCausalLM holding our weight tensors (views, no copies); (None, why) when it
    cannot be built here."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    except ImportError as e:
        return None, f"transformers not importable ({e})"
    c = config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.context_length,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):  # no memory, no random init: our tensors go in below
        model = LlamaForCausalLM(hf_config)

    def share(module: torch.nn.Module, tensor: torch.Tensor) -> None:
        module.weight = torch.nn.Parameter(tensor, requires_grad=False)

    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    share(model.model.embed_tokens, weights.embed)
    share(model.model.norm, weights.norm)
    share(model.lm_head, weights.lm_head)
    for hf_layer, layer in zip(model.model.layers, weights.layers, strict=True):
        q, k, v = layer.qkv.split([q_size, kv_size, kv_size])
        gate, up = layer.gate_up.chunk(2)
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        for module, tensor in (
            (attn.q_proj, q),
            (attn.k_proj, k),
            (attn.v_proj, v),
            (attn.o_proj, layer.o),
            (mlp.gate_proj, gate),
            (mlp.up_proj, up),
            (mlp.down_proj, layer.down),
            (hf_layer.input_layernorm, layer.attn_norm),
            (hf_layer.post_attention_layernorm, layer.ffn_norm),
        ):
            share(module, tensor)
    model.model.rotary_emb = LlamaRotaryEmbedding(hf_config).to(device)
    still_meta = [
        name
        for name, t in (*model.named_parameters(), *model.named_buffers())
        if t.device.type == "meta"
    ]
    if still_meta:
        return None, f"transformers' Llama has tensors we do not fill: {still_meta[:3]}"
    return model.eval(), ""


def _measure(
    runner: ModelRunner,
    hf_model: Any,
    hf_missing: str,
    case: _Case,
    setup: StepSetup,
    timer: Callable[[Callable[[], object]], float],
) -> None:
    config, device = setup.config, runner.model.device
    batch, context = case.batch, case.context
    per_row = blocks_needed(context, BLOCK_SIZE)
    seq_ids = [f"row{r}" for r in range(batch)]
    new = [
        NewSequence(seq_id=s, sampling=GREEDY, block_ids=[*range(r * per_row, (r + 1) * per_row)])
        for r, s in enumerate(seq_ids)
    ]
    tokens = [(7919 * r + 11) % config.vocab_size for r in range(batch)]
    rows = [
        StepRow(seq_id=s, token_ids=[t], start_pos=context - 1, sample=True)
        for s, t in zip(seq_ids, tokens, strict=True)
    ]
    runner.execute(StepPlan(step_id=0, finished_seq_ids=list(runner.sequences), new_seqs=new))
    plan = StepPlan(step_id=1, rows=rows)
    first = runner.execute(plan)  # also the warm-up
    if first.error is not None:
        raise RuntimeError(f"decode step failed: {first.error.message}")
    # The step writes the same keys and values at the same slots every time: it can repeat.
    host = runner.host_batch(rows)
    with torch.inference_mode():
        logits = runner.logits(host).float().clone()  # [B, V]
    case.tokens, case.logits = tokens, logits
    step_ms = timer(lambda: runner.execute(plan))
    graphs = runner.graphs is not None and runner.graphs.covers(host)
    if graphs:
        assert runner.graphs is not None
        replay = runner.graphs.replays[batch]
        forward_ms = timer(replay)
    else:
        forward_ms = timer(lambda: runner.logits(host))
    case.extra.update(
        step_us=step_ms * 1e3,
        forward_us=forward_ms * 1e3,
        cuda_graph=graphs,
        finite=bool(torch.isfinite(logits).all()),
    )
    if hf_model is None:
        case.note = f"transformers skipped: {hf_missing}"
        return
    room = _free_bytes(device)
    need = kv_bytes(config, setup.dtype, batch, context) + HEADROOM_BYTES
    if room is not None and need > room:
        case.note = f"transformers skipped: needs {need / GIB:.0f} GiB, {room / GIB:.0f} free"
        return
    try:
        hf_logits, hf_ms = _transformers_step(hf_model, runner.kv_cache, case, tokens, timer)
    except Exception as e:  # theirs failing leaves our measurement standing
        log.exception("transformers' decode step failed")
        case.note = f"transformers failed: {type(e).__name__}: {e}"
        return
    ref = hf_logits.double()
    rel = float((logits.double() - ref).norm() / ref.norm())
    agree = float((logits.argmax(-1) == hf_logits.argmax(-1)).float().mean())
    speedup = hf_ms / step_ms
    case.extra.update(
        transformers_us=hf_ms * 1e3,
        rel_error=rel,
        argmax_agreement=agree,
        speedup_vs_transformers=speedup,
        meets_transformers_target=speedup >= TRANSFORMERS_SPEEDUP_TARGET,
    )
    case.note = f"{speedup:.1f}x transformers ({hf_ms * 1e3:.0f} us)"
    if device.type == "cuda":  # the target is for the GPU path
        verdict = "meets" if speedup >= TRANSFORMERS_SPEEDUP_TARGET else "MISSES"
        case.note += f": {verdict} {TRANSFORMERS_SPEEDUP_TARGET:.0f}x target"


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _transformers_step(
    model: Any,
    kv_cache: KVCache,
    case: _Case,
    tokens: list[int],
    timer: Callable[[Callable[[], object]], float] | None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, float]:
    """transformers' logits [B, V] for the same step over the same cached tokens (cast to
    `dtype` where given), and the time of one of its decode steps in ms (0 without a timer)."""
    from transformers import DynamicCache

    batch, context = case.batch, case.context
    per_row = blocks_needed(context, BLOCK_SIZE)
    device = kv_cache.k[0].device
    _, block_size, kv_heads, head_dim = kv_cache.k[0].shape
    cache = DynamicCache()
    with torch.inference_mode():
        for layer, (k, v) in enumerate(zip(kv_cache.k, kv_cache.v, strict=True)):
            # Row r's blocks are r * per_row onwards, in order: its tokens lie contiguous.
            rows_k, rows_v = (
                c[: batch * per_row]
                .view(batch, per_row * block_size, kv_heads, head_dim)[:, : context - 1]
                .transpose(1, 2)  # [B, Hkv, context - 1, D]
                .to(dtype or c.dtype)
                for c in (k, v)
            )
            cache.update(rows_k, rows_v, layer)  # copies: transformers' own cache
    input_ids = torch.tensor(tokens, device=device).view(batch, 1)
    position_ids = torch.full((batch, 1), context - 1, device=device)

    def step() -> torch.Tensor:
        # Newer releases rename past_key_values (with a warning); older ones know no other.
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            out = model(
                input_ids=input_ids,
                past_key_values=cache,
                position_ids=position_ids,
                use_cache=True,
            ).logits  # [B, 1, V]
            # Forget the token just appended, so that every step starts from the same cache.
            for layer in cache.layers:
                layer.keys = layer.keys[..., : context - 1, :]
                layer.values = layer.values[..., : context - 1, :]
        return out

    logits = step()[:, -1].float()  # [B, V]
    return logits, 0.0 if timer is None else timer(step)


def _result(
    result_type: type,
    case: _Case,
    setup: StepSetup,
    weights: ModelWeights,
    copy_gbps: float | None,
) -> Any:
    config, dtype = setup.config, setup.dtype
    mode = "graph" if case.extra.get("cuda_graph") else "eager"
    shape = (
        f"{setup.label} B={case.batch} ctx={case.context} "
        f"{str(dtype).removeprefix('torch.')} {mode if case.fits else ''}"
    ).strip()
    floor_bytes = weight_bytes_read(weights, case.batch) + kv_bytes(
        config, dtype, case.batch, case.context
    )
    extra: dict[str, Any] = {
        "batch": case.batch,
        "context": case.context,
        "floor_bytes": floor_bytes,
        **case.extra,
    }
    if copy_gbps:
        extra["floor_us"] = floor_bytes / (copy_gbps * 1e9) * 1e6
    if case.note:
        extra["note"] = case.note
    if case.error:
        extra["note"] = f"FAILED: {case.error}"[:300]
    if not case.fits or case.error or "step_us" not in case.extra:
        return result_type(
            name="decode_step",
            shape=shape,
            time_us=0.0,
            gbps=0.0,
            bw_fraction=None,
            tflops=None,
            rel_error=0.0,
            ok=not case.error,
            extra=extra,
        )
    step_s = case.extra["step_us"] * 1e-6
    gbps = floor_bytes / step_s / 1e9
    fraction = gbps / copy_gbps if copy_gbps else None
    target = STEP_FLOOR_TARGET if case.batch == STEP_TARGET_BATCH else None
    rel = case.extra.get("rel_error", 0.0)
    return result_type(
        name="decode_step",
        shape=shape,
        time_us=case.extra["step_us"],
        gbps=gbps,
        bw_fraction=fraction,
        tflops=step_flops(config, case.batch, case.context) / step_s / 1e12,
        rel_error=rel,
        ok=case.extra["finite"] and rel < case.extra.get("tolerance", setup.tolerance),
        target=target,
        meets_target=None if target is None or fraction is None else fraction >= target,
        extra=extra,
    )


def main(argv: list[str] | None = None) -> int:
    return bench_main(
        argv,
        sections={**SECTIONS, "decode_step": bench_decode_step},
        prog="python -m bench.decode_step",
    )


if __name__ == "__main__":
    sys.exit(main())
