"""A hybrid decoder: recurrent layers (a state per sequence in `state_pool.StatePool`)
among attention layers (the paged KV cache), each followed by a MoE feed-forward with a
shared MLP: Granite 4.0-H (`granite_hybrid`: Mamba2 mixers) and Qwen3-Next
(`qwen3_next`: gated DeltaNet mixers). Attention is the shared piece
(`layers.attention`) with the family's options; the family modules read the layers.

One forward runs a flat batch (`forward_batch.ForwardBatch`) whose `state_slots` name each row's
state slot; rows flagged `state_fresh` start from zero, and `state_takes` copy a row's
states at a block boundary into a snapshot (prefix caching). The model is tested against
transformers directly and served by `loading.load_runner`. It never takes the
one-call Llama decode loop (its layers are not plain).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spillway.kernels.cpu.ops import CpuAbilities
from spillway.kernels.ops import KernelOps
from spillway.services.worker.expert_parallel import ExpertGroup
from spillway.services.worker.forward_batch import ForwardBatch
from spillway.services.worker.kv_cache import KVCache
from spillway.services.worker.layers.attention import Attention
from spillway.services.worker.layers.gated_delta import (
    GatedDeltaWeights,
    gated_delta_dims,
    gated_delta_mixer,
)
from spillway.services.worker.layers.mamba2 import Mamba2Weights, mamba2_dims, mamba2_mixer
from spillway.services.worker.layers.moe import MoEWeights, moe_forward
from spillway.services.worker.models.llama import WARM_UP_ROWS
from spillway.services.worker.state_pool import StateLayerSpec, StatePool
from spillway.services.worker.tensor_files import safetensors_tensors
from spillway.services.worker.weights import LayerWeights, MtpWeights
from spillway.shared.model_config import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class HybridLayer:
    attn_norm: torch.Tensor  # [H]
    ffn_norm: torch.Tensor  # [H]
    moe: MoEWeights  # routed experts (may be none) and the shared MLP
    mamba: Mamba2Weights | None = None  # a Mamba2 layer, else attention:
    attention: LayerWeights | None = None  # qkv and o (Qwen3-Next: q/k norms too)
    delta: GatedDeltaWeights | None = None  # a gated DeltaNet layer (Qwen3-Next)

    @classmethod
    def read(cls, norm: Callable[[str], torch.Tensor], prefix: str, moe: MoEWeights) -> HybridLayer:
        """The layer at `prefix` with its two norms as the family reads a norm (`norm`) and
        its feed-forward `moe`; its mixer or attention is set after."""
        return cls(
            attn_norm=norm(f"{prefix}.input_layernorm.weight"),
            ffn_norm=norm(f"{prefix}.post_attention_layernorm.weight"),
            moe=moe,
        )

    def mixer(self) -> tuple[Callable[..., torch.Tensor], Mamba2Weights | GatedDeltaWeights] | None:
        """The layer's state-space mixer and its weights (both mixers take the same
        arguments); None for an attention layer."""
        if self.mamba is not None:
            return mamba2_mixer, self.mamba
        if self.delta is not None:
            return gated_delta_mixer, self.delta
        return None


def dense_ffn(gate_up: torch.Tensor, down: torch.Tensor) -> MoEWeights:
    """A layer's plain MLP in the MoE slot: no router, no experts, the MLP as the shared
    one (the feed-forward runs it alone)."""
    empty = torch.empty(0)
    return MoEWeights(
        router=empty, w_gate_up=empty, w_down=empty, shared_gate_up=gate_up, shared_down=down
    )


def pop_weight(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The checkpoint's tensor `name`, popped (a family's reader takes each one once)."""
    if name not in tensors:
        raise KeyError(f"weight {name!r} missing from the model files")
    return tensors.pop(name)


def attention_weights(
    layer: HybridLayer, take: Callable[[str], torch.Tensor], prefix: str, **norms: torch.Tensor
) -> LayerWeights:
    """An attention layer's projections from its checkpoint (`prefix`: its self_attn;
    q, k and v joined), with the layer's norms (and `norms`: q_norm, k_norm where the
    family has them); the feed-forward is the layer's MoE slot."""
    qkv = torch.cat([take(f"{prefix}.{n}_proj.weight") for n in "qkv"]).contiguous()
    return LayerWeights(
        attn_norm=layer.attn_norm, qkv=qkv, qkv_bias=None, o=take(f"{prefix}.o_proj.weight"),
        ffn_norm=layer.ffn_norm, gate_up=None, down=None, **norms,
    )  # fmt: skip


def state_specs(config: ModelConfig) -> list[StateLayerSpec | None]:
    """Per layer, the state pool's shapes (None for attention)."""
    c = config.hybrid
    assert c is not None
    specs: list[StateLayerSpec | None] = []
    for kind in c.layer_kinds:
        if kind == "mamba2":
            _inner, conv_dim = mamba2_dims(c)
            shape = (c.mamba_heads, c.mamba_head_dim, c.mamba_state)
            specs.append(StateLayerSpec(kind, conv_dim, c.conv_width, shape))
        elif kind == "gated_delta":
            _key, conv_dim = gated_delta_dims(c)
            shape = (c.linear_v_heads, c.linear_k_dim, c.linear_v_dim)
            specs.append(StateLayerSpec(kind, conv_dim, c.conv_width, shape))
        elif kind == "attention":
            specs.append(None)
        else:
            raise ValueError(f"{config.architecture}: layer kind {kind!r} is not run yet")
    return specs


class HybridModel:
    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[HybridLayer],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
        ops: KernelOps,
        max_positions: int | None = None,
    ) -> None:
        assert config.hybrid is not None
        self.config, self.hybrid = config, config.hybrid
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.ops = ops
        self.max_positions = max_positions or config.context_length
        # Granite's softmax scale is attention_multiplier; Qwen3-Next's q_proj yields each
        # head's query and its output gate, and only the first partial_rotary_factor of
        # each head's dims rotate.
        self.attention = Attention(
            config, ops, embed.device, self.max_positions,
            scale=self.hybrid.attention_multiplier,
            rotary_dim=int(config.head_dim * self.hybrid.partial_rotary_factor),
            rotate=self.hybrid.rope,
            gated=config.architecture == "qwen3_next",
        )  # fmt: skip
        # The routed experts through an expert-parallel group (which also counts each
        # expert's tokens), else in this process.
        self.experts: ExpertGroup | None = None
        # The multi-token-prediction layer, loaded only for `--speculative mtp`.
        self.mtp: MtpWeights | None = None

    # No decode CUDA graphs: the recurrent layers' prefill loop reads lengths on the host.
    capturable = False

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def warm_up(self) -> None:
        """Every projection at one row and at WARM_UP_ROWS, and the experts, so one-time
        packing (the CPU backend's, the int8 mode's int8 weights) happens at start-up."""
        weights = [self.lm_head]
        for layer in self.layers:
            for part in (layer.mamba, layer.delta):
                if part is not None:
                    weights += [t for t in vars(part).values() if _is_projection(t)]
            if layer.attention is not None:
                weights += [layer.attention.qkv, layer.attention.o]
            shared = (layer.moe.shared_gate_up, layer.moe.shared_down, layer.moe.shared_gate)
            weights += [t for t in shared if t is not None]
        with torch.inference_mode():
            for w in weights:
                for rows in (1, WARM_UP_ROWS):
                    x = torch.zeros(rows, w.shape[1], dtype=w.dtype, device=w.device)
                    self.ops.linear(x, w)
            if isinstance(self.ops, CpuAbilities) and self.device.type == "cpu":
                for layer in self.layers:  # the int8 mode's experts, as a prefill makes them
                    moe = layer.moe
                    if moe.w_gate_up.shape[0]:  # not a dense layer's MLP alone
                        self.ops.warm_experts(moe.w_gate_up, moe.w_down, WARM_UP_ROWS)

    def num_bytes(self) -> int:
        """The weights' memory, each tensor once (a tied head is the embedding)."""
        tensors: dict[int, torch.Tensor] = {}
        parts: list[object] = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            parts += [layer.attn_norm, layer.ffn_norm, layer.moe, layer.mamba, layer.delta,
                      layer.attention]  # fmt: skip
        for part in parts:
            if part is None:
                continue
            values = [part] if isinstance(part, torch.Tensor) else list(vars(part).values())
            for t in values:
                if isinstance(t, torch.Tensor):
                    tensors[t.data_ptr()] = t
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def new_state_pool(self, num_slots: int) -> StatePool:
        return StatePool(state_specs(self.config), num_slots, self.embed.device)

    def forward(
        self,
        batch: ForwardBatch,
        kv_cache: KVCache,
        pool: StatePool,
        snapshots: StatePool | None = None,
    ) -> torch.Tensor:
        """Logits [S, V] float32 for the sampling rows ([T, V] when batch.logits_indices is
        None); writes this step's K/V, updates the rows' states and copies them into
        `snapshots` where `batch.state_takes` says."""
        x = self._layers(batch, kv_cache, pool, snapshots)
        idx = batch.logits_indices
        if idx is not None:
            x = x[idx]
        return self._logits(self.ops.rms_norm(x, self.norm, self.config.rms_norm_eps))

    def forward_with_hidden(
        self,
        batch: ForwardBatch,
        kv_cache: KVCache,
        pool: StatePool,
        snapshots: StatePool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits and every token's final normed hidden state [T, H] (what a
        multi-token-prediction layer reads)."""
        x = self._layers(batch, kv_cache, pool, snapshots)
        h = self.ops.rms_norm(x, self.norm, self.config.rms_norm_eps)
        idx = batch.logits_indices
        return self._logits(h if idx is None else h[idx]), h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(h, self.lm_head).float() / self.hybrid.logits_scaling

    def mtp_layer(
        self,
        x: torch.Tensor,  # [T, H]
        layer: HybridLayer,  # an attention layer
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """One attention layer with its feed-forward, outside the stack (a multi-token-
        prediction layer, Qwen3-Next's): its output with the residual added."""
        assert layer.attention is not None
        eps, scale = self.config.rms_norm_eps, self.hybrid.residual_multiplier
        h = self.ops.rms_norm(x, layer.attn_norm, eps)
        x = x + self.attention.forward(h, layer.attention, batch, k_cache, v_cache) * scale
        h = self.ops.rms_norm(x, layer.ffn_norm, eps)
        return x + self._feed_forward(h, layer.moe) * scale

    def _layers(
        self,
        batch: ForwardBatch,
        kv_cache: KVCache,
        pool: StatePool,
        snapshots: StatePool | None,
    ) -> torch.Tensor:
        """The residual stream [T, H] after the last layer (before the final norm)."""
        c, h_cfg, ops = self.config, self.hybrid, self.ops
        eps = c.rms_norm_eps
        slots = batch.state_slots
        if slots is None:
            raise ValueError("a hybrid model's batch needs state_slots")
        pool.reset(slots, batch.state_fresh)
        x = F.embedding(batch.token_ids, self.embed) * h_cfg.embedding_multiplier
        for i, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.attn_norm, eps)
            snaps = None
            if snapshots is not None and batch.state_takes and pool.conv[i] is not None:
                snap_conv, snap_ssm = snapshots.conv[i], snapshots.ssm[i]
                assert snap_conv is not None and snap_ssm is not None
                snaps = (snap_conv, snap_ssm)
            takes = batch.state_takes if snaps is not None else ()
            mixer = layer.mixer()
            if mixer is not None:
                run, weights = mixer
                conv, state = pool.conv[i], pool.ssm[i]
                assert conv is not None and state is not None
                out = run(
                    ops, h_cfg, eps, h, weights, conv, state, batch.query_start, slots,
                    batch.max_query_len, takes, snaps,
                )  # fmt: skip
            else:
                assert layer.attention is not None
                out = self.attention.forward(
                    h, layer.attention, batch, kv_cache.k[i], kv_cache.v[i]
                )
            x = x + out * h_cfg.residual_multiplier
            h = ops.rms_norm(x, layer.ffn_norm, eps)
            x = x + self._feed_forward(h, layer.moe) * h_cfg.residual_multiplier
        return x

    def _feed_forward(self, h: torch.Tensor, w: MoEWeights) -> torch.Tensor:
        moe = self.config.moe
        assert moe is not None
        if w.router.numel() > 0 and self.experts is not None:
            return self.experts.forward(self.ops, moe, h, w)
        if w.router.numel() > 0:
            return moe_forward(self.ops, moe, h, w)
        assert w.shared_gate_up is not None and w.shared_down is not None
        return self.ops.linear(
            self.ops.silu_mul(self.ops.linear(h, w.shared_gate_up)), w.shared_down
        )


def _is_projection(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1


# (tensors, config, dtype, the model's embedding, its head) -> the MTP layer's MtpWeights.
MtpReader = Callable[
    [dict[str, torch.Tensor], ModelConfig, torch.dtype, torch.Tensor, torch.Tensor], MtpWeights
]


def load_hybrid_model(
    folder: Path,
    config: ModelConfig,
    read_layers: Callable[[dict[str, torch.Tensor], ModelConfig, torch.dtype], list[HybridLayer]],
    ops: KernelOps,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    one_plus_norm: bool = False,
    read_mtp: MtpReader | None = None,
    max_positions: int | None = None,
) -> HybridModel:
    """A hybrid model from a Hugging Face folder, its layers read by its family's
    `read_layers` (`models.registry.load_hybrid_model` picks it); with `read_mtp`, its
    multi-token-prediction layer too. `max_positions`: past the config's (a draft model
    serving its target's context)."""
    tensors = {name: t.to(device) for name, t in safetensors_tensors(folder).items()}
    layers = read_layers(tensors, config, dtype)
    embed = tensors.pop("model.embed_tokens.weight").to(dtype)
    lm = tensors.pop("lm_head.weight", None)
    lm_head = embed if config.tie_word_embeddings or lm is None else lm.to(dtype)
    norm = tensors.pop("model.norm.weight").float()
    if one_plus_norm:  # (1 + w), as its layers' norms
        norm = 1.0 + norm
    norm = norm.to(dtype)
    model = HybridModel(config, embed, layers, norm, lm_head, ops, max_positions)
    if read_mtp is not None:
        model.mtp = read_mtp(tensors, config, dtype, embed, lm_head)
    leftover = [k for k in tensors if not k.endswith("rotary_emb.inv_freq")]
    if leftover:  # an MTP module unless asked for (`--speculative mtp`)
        log.warning("ignored %d unused tensors, e.g. %s", len(leftover), leftover[:3])
    return model
