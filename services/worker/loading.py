"""The worker's start-up: from the settings to a ready `ModelRunner` (the weights themselves
are read by `loader.py` and the families' modules).

One path serves every family, in this order: resolve the model and the device, threads,
dtypes and kernels; the config and the refusals that need only it; the model; the
expert-parallel group; the draft model; the state pool (a model that keeps recurrent
state); the KV cache in the memory left; the runner with its drafters; the decode graphs.
What differs between families is named in two pieces:

    load_family_model   the model (the Llama decoder over `ModelWeights`, or the hybrid
                        decoder with its recurrent layers), its MTP layer and the layers
                        an expert-parallel group splits
    StateLayout         the recurrent states' pool: one slot per sequence that may run at
                        once, snapshots at block boundaries (prefix caching) and, when
                        speculating, the states at each draft position
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from spillway.kernels.ops import KernelOps, select_ops
from spillway.services.worker.cuda_graphs import graph_batch_sizes
from spillway.services.worker.draft_model import DraftModelDrafter, DraftModelStates
from spillway.services.worker.draft_states import DraftStates
from spillway.services.worker.ep_group import agree_num_blocks, join_group
from spillway.services.worker.expert_parallel import ExpertGroup
from spillway.services.worker.kv_cache import (
    KVCache,
    block_bytes,
    num_blocks_for_memory,
    resolve_kv_dtype,
)
from spillway.services.worker.kv_transfer import KVTransfer, connect_kv_store
from spillway.services.worker.loader import load_model, resolve_device, resolve_dtype
from spillway.services.worker.models.hybrid import HybridModel, state_specs
from spillway.services.worker.models.llama import LlamaModel
from spillway.services.worker.models.registry import (
    check_servable,
    load_hybrid_model,
    load_model_config,
)
from spillway.services.worker.mtp import MtpCache, MtpDrafter
from spillway.services.worker.runner import ModelRunner
from spillway.services.worker.sampling_state import load_sampling_states
from spillway.services.worker.state_pool import StatePool
from spillway.services.worker.threads import configure_threads
from spillway.services.worker.warm_prefill import warm_prefill
from spillway.services.worker.weights import MtpWeights
from spillway.shared.config import Settings
from spillway.shared.expert_parallel import check_expert_parallel
from spillway.shared.model_config import ModelConfig
from spillway.shared.model_files import ModelSource, resolve_model, weights_fingerprint
from spillway.shared.serving import served_context_length
from spillway.shared.speculative import speculation_refusal
from spillway.shared.spill_keys import SpillKeys

log = logging.getLogger(__name__)

Model = LlamaModel | HybridModel


def load_runner(settings: Settings) -> tuple[ModelRunner, str]:
    """Loads the configured model, sizes its state pool and KV cache and, on CUDA,
    captures the decode graphs; returns the runner and the model id."""
    source = resolve_model(settings.model)
    check_servable(source)  # before any weight loads
    device = resolve_device(settings.device)
    configure_threads(device, settings.threads)
    dtype = resolve_dtype(settings.dtype, device, settings.auto_dtype)
    kv_dtype = resolve_kv_dtype(settings.kv_cache_dtype, dtype, device)
    # Before the weights load: a backend that cannot run here fails at once.
    native_dir = settings.cache_dir if settings.cpu_native_kernels else None
    ops = select_ops(
        settings.attention_backend, device, native_dir=native_dir, quantize=settings.quantize
    )
    model_config = load_model_config(source)
    served_context_length(model_config.context_length, settings.max_model_len)  # before loading
    refusal = speculation_refusal(settings, model_config)
    if refusal is not None:
        raise ValueError(refusal)
    check_expert_parallel(settings, model_config, source.model_id)
    # --quantize int8 quantizes float32 weights for its many-row products: those load
    # dequantized; the exact mode keeps a GGUF file's blocks alone.
    keep_quantized = settings.quantize != "int8"
    mtp = settings.speculative == "mtp"
    loaded = load_family_model(source, model_config, device, dtype, ops, mtp, keep_quantized)
    model, config = loaded.model, loaded.model.config
    group = join_group(settings, device) if settings.expert_parallel > 1 else None
    if group is not None:
        group.shard(loaded.expert_layers)
    if config.moe is not None and config.moe.num_experts > 0:
        model.experts = group or ExpertGroup(0, 1)  # counts tokens per expert even alone
    draft = load_draft_model(settings, config, device, dtype, ops) if settings.draft_model else None
    states = StateLayout.of(settings, model, draft.model if draft else None)
    num_blocks = settings.kv_blocks or num_blocks_for_memory(
        # The MTP layer's cache plane shares the target's blocks: one more layer a block.
        dataclasses.replace(config, num_layers=config.num_layers + 1) if loaded.mtp else config,
        settings.block_size,
        kv_dtype,
        device,
        # On CUDA, the state pool is gone from the free memory the budget reads.
        settings.cpu_kv_cache_bytes - (states.num_bytes if states else 0),
        settings.gpu_memory_utilization,
    )
    num_blocks = agree_num_blocks(draft_share(settings, config, draft, num_blocks, kv_dtype))
    kv_cache = KVCache(config, num_blocks, settings.block_size, kv_dtype, device)
    model.warm_up()
    log.info(
        "loaded %s (%s, %.0f MiB of weights) on %s as %s with %s kernels%s",
        source.model_id, source.kind, loaded.num_bytes / 2**20, device, dtype, ops.name,
        states.describe() if states else "",
    )  # fmt: skip
    runner = ModelRunner(
        model,  # type: ignore[arg-type]
        kv_cache,
        kv_transfer=kv_transfer_for(settings, kv_cache),
        sampling=load_sampling_states(settings, source, config),
        state_pool=states.pool if states else None,
        state_snapshots=states.snapshots if states else None,
    )
    if states is not None:
        runner.num_state_snapshots = states.num_snapshots
        if states.num_scratch and runner.target_states is not None:
            runner.draft_states = DraftStates(base=states.num_snapshots, k_max=states.k_max)
    runner.kv_layout = kv_layout(source, config, dtype, settings.block_size, kv_dtype)
    runner.max_model_len_cap = served_context_length(config.context_length, settings.max_model_len)
    if loaded.mtp is not None:
        cache = MtpCache(kv_cache)
        runner.mtp = MtpDrafter(model, loaded.mtp, cache, settings.num_speculative_tokens)  # type: ignore[arg-type]
    if draft is not None:
        runner.draft = draft_drafter(settings, draft.model, runner, kv_dtype, states)
    if device.type == "cpu":  # the one-time work it absorbs is the CPU backend's
        context = runner.max_model_len_cap or config.context_length
        warm_prefill(runner, config.vocab_size, min(settings.max_num_batched_tokens, context - 1))
    start_decode_graphs(runner, settings, device, ops.name, group)
    return runner, source.model_id


@dataclass
class LoadedModel:
    """What a family's loader gives the start-up."""

    model: Model
    mtp: MtpWeights | None  # the MTP layer (`--speculative mtp`)
    expert_layers: list[Any]  # the layers whose `moe` an expert-parallel group splits
    num_bytes: int  # the weights' memory (the start-up log line)


def load_family_model(
    source: ModelSource,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    ops: KernelOps,
    mtp: bool = False,
    keep_quantized: bool = True,
    max_positions: int | None = None,
) -> LoadedModel:
    """The model as its family runs it: a hybrid family's decoder (recurrent layers among
    attention, from a Hugging Face folder), else the Llama decoder over any source; with
    `mtp`, its multi-token-prediction layer too. `max_positions`: past the config's (a
    draft model serving its target's context)."""
    if config.hybrid is not None:
        hybrid = load_hybrid_model(
            source.path, config, ops, dtype, device, mtp=mtp, max_positions=max_positions
        )
        layers: list[Any] = list(hybrid.layers)
        if hybrid.mtp is not None:
            layers.append(hybrid.mtp.layer)
        return LoadedModel(hybrid, hybrid.mtp, layers, hybrid.num_bytes())
    config, weights = load_model(source, device, dtype, mtp=mtp, keep_quantized=keep_quantized)
    layers = list(weights.layers)
    if weights.mtp is not None:
        layers.append(weights.mtp.layer)
    model = LlamaModel(config, weights, ops, max_positions=max_positions)
    return LoadedModel(model, weights.mtp, layers, weights.num_bytes())


@dataclass
class StateLayout:
    """The recurrent states of the target and of a draft model, where either keeps them:
    `num_slots` running sequences (--state-slots, else --max-batch); `num_snapshots` for
    prefix caching (--state-snapshots, else as many as slots), then `num_scratch` for
    speculation (the states at each of up to `k_max` draft positions per slot,
    `draft_states`), all in one snapshot pool. One pool holds both models' layers, the
    target's first (`target_layers` of them): a slot's spill, snapshot and copy carry
    both, so the scheduler manages the draft's state as it manages a hybrid target's."""

    pool: StatePool
    snapshots: StatePool | None
    num_snapshots: int
    num_scratch: int
    k_max: int
    target_layers: int

    @staticmethod
    def of(settings: Settings, model: Model, draft: Model | None = None) -> StateLayout | None:
        """None where neither model keeps recurrent state."""
        target = state_specs(model.config) if isinstance(model, HybridModel) else []
        drafts = state_specs(draft.config) if isinstance(draft, HybridModel) else []
        if not target and not drafts:
            return None
        num_slots = settings.state_slots or settings.max_batch
        num_snapshots = num_slots if settings.state_snapshots is None else settings.state_snapshots
        k_max = settings.num_speculative_tokens if settings.speculative != "none" else 0
        num_scratch = DraftStates.count(num_slots, k_max)
        total = num_snapshots + num_scratch
        specs, device = [*target, *drafts], model.device
        return StateLayout(
            pool=StatePool(specs, num_slots, device),
            snapshots=StatePool(specs, total, device) if total else None,
            num_snapshots=num_snapshots,
            num_scratch=num_scratch,
            k_max=k_max,
            target_layers=len(target),
        )

    def draft_views(self) -> tuple[StatePool, StatePool | None]:
        """The draft model's layers of the pool and of the snapshots."""
        n = len(self.pool.specs)
        snapshots = self.snapshots.layers(self.target_layers, n) if self.snapshots else None
        return self.pool.layers(self.target_layers, n), snapshots

    @property
    def num_bytes(self) -> int:
        """The pool's and the snapshots' memory (taken from the KV cache's budget)."""
        total = self.pool.num_slots + (self.snapshots.num_slots if self.snapshots else 0)
        return total * self.pool.slot_bytes()

    def describe(self) -> str:
        return (
            f"; state pool: {self.pool.num_slots} slots and {self.num_snapshots} snapshots"
            f" x {self.pool.slot_bytes() / 1024:.1f} KiB"
        )


def load_draft_model(
    settings: Settings,
    target: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    ops: KernelOps,
) -> LoadedModel:
    """`--draft-model`, as its family runs it (a hybrid one keeps its recurrent state in
    the target's state slots: `StateLayout`), its positions reaching the target's served
    context; refused unless its vocabulary is the target's."""
    assert settings.draft_model is not None
    source = resolve_model(settings.draft_model)
    check_servable(source)
    config = load_model_config(source)
    if config.vocab_size != target.vocab_size:  # before its weights load
        raise ValueError(
            f"--draft-model {settings.draft_model}: vocabulary of {config.vocab_size} tokens,"
            f" the model's has {target.vocab_size} (the draft needs the same tokenizer)"
        )
    context = served_context_length(target.context_length, settings.max_model_len)
    keep_quantized = settings.quantize != "int8"
    return load_family_model(
        source, config, device, dtype, ops, keep_quantized=keep_quantized, max_positions=context
    )


def draft_share(
    settings: Settings,
    config: ModelConfig,
    draft: LoadedModel | None,
    num_blocks: int,
    kv_dtype: torch.dtype,
) -> int:
    """The target's blocks once a draft model's cache takes its share of the memory."""
    if draft is None or settings.kv_blocks:
        return num_blocks
    own = block_bytes(config, settings.block_size, kv_dtype)
    other = block_bytes(draft.model.config, settings.block_size, kv_dtype)
    return max(1, num_blocks * own // (own + other))


def draft_drafter(
    settings: Settings,
    model: Model,
    runner: ModelRunner,
    kv_dtype: torch.dtype,
    states: StateLayout | None,
) -> DraftModelDrafter:
    """The draft model over a cache of its own under the target's block ids (and, for a
    hybrid draft, its layers of the state pool)."""
    cache = runner.kv_cache
    device = cache.k[0].device
    own = KVCache(model.config, cache.num_blocks, settings.block_size, kv_dtype, device)
    k = settings.num_speculative_tokens
    if not isinstance(model, HybridModel):
        return DraftModelDrafter(model, own, k)
    assert states is not None and states.num_scratch  # a draft model speculates
    pool, snapshots = states.draft_views()
    assert snapshots is not None
    kept = DraftModelStates(pool, snapshots, base=states.num_snapshots, stride=states.k_max)
    return DraftModelDrafter(model, own, k, kept)


def start_decode_graphs(
    runner: ModelRunner,
    settings: Settings,
    device: torch.device,
    backend: str,
    group: ExpertGroup | None,
) -> None:
    """Captures the decode CUDA graphs where they can run, saying why where they cannot."""
    if runner.mtp is not None:
        log.info("decode CUDA graphs off: the MTP drafter reads each step's hidden states")
    elif not graphs_wanted(settings, device, backend):
        return
    elif not runner.model.capturable:
        config = runner.model.config
        what = "recurrent layers" if config.hybrid is not None else "attention"
        log.info("decode CUDA graphs off: this %s's %s reads lengths back", config.architecture,
                 what)  # fmt: skip
    elif group is None:  # no collectives in graphs
        sizes = graph_batch_sizes(settings.max_batch, settings.cuda_graph_sizes)
        try:
            runner.capture_decode_graphs(sizes)
        except Exception:  # serving slower beats not serving
            log.exception("decode CUDA graph capture failed: decode steps run eagerly")
            runner.graphs = None


def kv_transfer_for(settings: Settings, kv_cache: KVCache) -> KVTransfer | None:
    """The spill store's data plane, when this system has a spill store."""
    if not settings.spill_store:
        return None
    client = connect_kv_store(settings.redis_url, settings.kv_store_timeout_s)
    return KVTransfer(
        client,
        SpillKeys(settings.namespace),
        kv_cache,
        group_blocks=settings.spill_group_blocks,
        ttl_s=settings.spill_ttl_s,
    )


def kv_layout(
    source: ModelSource,
    config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
) -> str:
    """What one KV block's bytes mean: whose weights, which precision, which geometry.
    A cache in another dtype than the model's is named too (`+kv-bfloat16`): its blocks
    are neither the same bytes nor the same values, so a worker of another cache dtype
    never restores them (its swapped sequences and prefix hits are recomputed)."""
    name = str(dtype).removeprefix("torch.")
    if kv_dtype is not None and kv_dtype != dtype:
        name += "+kv-" + str(kv_dtype).removeprefix("torch.")
    return (
        f"{source.model_id}/{weights_fingerprint(source)}/{name}"
        f"/L{config.num_layers}/H{config.num_kv_heads}/D{config.head_dim}/B{block_size}"
    )


def graphs_wanted(settings: Settings, device: torch.device, backend: str) -> bool:
    """Decode graphs need CUDA and kernels that never read lengths back to the host (the
    torch backend sizes its gathers from them)."""
    if not settings.cuda_graphs or device.type != "cuda":
        return False
    if backend != "triton":
        log.info("decode CUDA graphs off: the %s backend reads lengths back to the host", backend)
        return False
    return True
