"""A Llama-family decoder (GQA, RoPE, RMSNorm, SwiGLU) over a paged KV cache.

The families differ by configuration over the same pieces: q/k biases (Qwen2), per-head
q/k norms (Qwen3), sliding windows (Mistral), a MoE feed-forward in place of the dense
MLP on some or all layers (`moe.moe_forward`: Qwen3-MoE, Mixtral), and Gemma's options
(`models/gemma.py`): a GeGLU MLP, scaled embeddings, norms on the attention's and the
MLP's outputs too, soft-capped attention scores and logits.

One forward runs a flat batch of T tokens from R rows: prefill chunks and decode rows
alike, each row's tokens packed back to back (`query_start`). Attention, KV stores, norms
and rotary go through `kernels.ops`, so the same model runs the torch path on CPU and the
Triton kernels on CUDA. Only the rows that sample get the final norm and the lm_head.

A step whose rows all hold one token (every row decoding) takes the decode attention fast
path; such a step is also what a decode CUDA graph captures (`cuda_graphs`), with every row's
logits computed and no value read back to the host along the way.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, cast

import torch
import torch.nn.functional as F

from spillway.kernels.cpu.decode_layers import Geometry, LayerTensors
from spillway.kernels.cpu.ops import CpuAbilities
from spillway.kernels.ops import KernelOps
from spillway.services.worker.expert_parallel import ExpertGroup
from spillway.services.worker.forward_batch import ForwardBatch
from spillway.services.worker.kv_cache import KVCache
from spillway.services.worker.layers.attention import Attention
from spillway.services.worker.layers.mla import LatentAttention
from spillway.services.worker.layers.moe import moe_forward
from spillway.services.worker.models.family import Family, refuse_options
from spillway.services.worker.weights import LayerWeights, ModelWeights
from spillway.shared.model_config import ModelConfig

log = logging.getLogger(__name__)
# Rows of warm_up's second pass: more than any few-row kernel takes (matvec.MAX_ROWS, and
# MAX_BLOCK_ROWS for weights in blocks, int8 included), so that it makes the many-row forms:
# at 8 a GGUF file's int8 prefill packed its weights in the first request (0.85 s of it).
WARM_UP_ROWS = 16


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        ops: KernelOps,
        max_positions: int | None = None,
    ) -> None:
        self.config = config
        self.weights = weights
        self.ops = ops
        self.max_positions = max_positions or config.context_length
        windows = [w for w in config.layer_windows if w is not None]
        # Windows and soft-capped scores run the torch attention (`window_attention`).
        torch_attention = bool(windows) or config.attn_logit_softcap is not None
        # The one-call decode loop runs plain Llama layers only (SwiGLU, no window or cap).
        self.plain = (
            not torch_attention
            and config.hidden_act == "silu"
            and all(layer.plain for layer in weights.layers)
        )
        # Expert parallel: this rank's share of the MoE layers and their exchange
        # (`expert_parallel.ExpertGroup`); None: every expert here.
        self.experts: ExpertGroup | None = None
        # Latent attention (DeepSeek-V3) in place of grouped-query attention on every layer.
        self.attention: Attention | LatentAttention = (
            LatentAttention(config, ops, weights.device, self.max_positions)
            if config.mla
            else Attention(config, ops, weights.device, self.max_positions)
        )
        self.cos, self.sin = self.attention.cos, self.attention.sin
        self.scale = self.attention.scale
        self.geometry = Geometry(
            config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps, self.scale
        )
        latent = (
            isinstance(self.attention, LatentAttention) and self.attention.latent_ops is not ops
        )
        # The torch attention (`window_attention`, any device) and latent attention on
        # torch ops (`mla`) read lengths back to the host.
        self.capturable = not latent and not torch_attention
        # Gemma's sqrt(hidden), a float32 scalar in the weights' dtype as transformers has it.
        self.embedding_scale = (
            None
            if config.embedding_scale == 1.0
            else torch.tensor(config.embedding_scale).to(weights.device, weights.dtype)
        )
        # What only the CPU backend does (tuning, the file's blocks, verify rows): None here
        # on any other backend.
        self.cpu_ops = ops if isinstance(ops, CpuAbilities) else None
        if self.cpu_ops is not None and weights.blocks:
            self.cpu_ops.use_source_blocks(weights.blocks)

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    def warm_up(self) -> None:
        """Runs every projection at one row and at WARM_UP_ROWS, so one-time work (the CPU
        backend packs each weight for its BLAS, or in int8 for its integer kernels, on first
        use, in a form for a few rows and another for many) happens at start-up, not in the
        first requests; on the CPU then times the choices of both forms and keeps the
        faster."""
        w = self.weights
        per_layer = [(x.qkv, x.o, x.gate_up) for x in w.layers] + [(x.down,) for x in w.layers]
        projections = [t for group in per_layer for t in group if t is not None] + [w.lm_head]
        with torch.inference_mode():
            for weight in projections:
                for rows in (1, WARM_UP_ROWS):
                    x = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
                    self.ops.linear(x, weight)
        if self.cpu_ops is None or self.device.type != "cpu":
            return
        for layer in w.layers:
            if layer.moe is not None:
                self.cpu_ops.warm_experts(layer.moe.w_gate_up, layer.moe.w_down, WARM_UP_ROWS)
        choice = self.cpu_ops.tune_few_rows(projections)
        if choice is not None:
            log.info("few-row projections: one thread below %d KiB of weights", choice >> 10)
        chosen = self.cpu_ops.tune_many_rows(projections)
        if chosen:
            log.info("many-row projections: %s", ", ".join(
                f"{'x'.join(map(str, shape))} {form}" for shape, form in chosen.items()
            ))  # fmt: skip

    def verify_rows(self) -> int | None:
        """Positions of one sequence a decode step computes each as a step of that token
        alone would (the native few-row path, weights read once for all): a speculative
        verify of more may round differently. None: no such bound here."""
        if self.cpu_ops is None or not self.plain or self.device.type != "cpu":
            return None
        w = self.weights
        layers = [(x.qkv, x.o, x.gate_up, x.down) for x in w.layers]
        projections = [t for group in layers for t in group if t is not None] + [w.lm_head]
        with torch.inference_mode():
            return self.cpu_ops.verify_rows(projections)

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Logits [S, V] float32 for the sampling rows ([T, V] when batch.logits_indices is
        None); writes this step's K/V to the cache. Reads nothing back to the host."""
        eps = self.config.rms_norm_eps
        x = self._embed(batch.token_ids)  # [T, H]
        at_once = (
            self._decode_layers(x, batch, kv_cache) if batch.decode_only and self.plain else None
        )
        x, residual = at_once if at_once is not None else self._layers(x, batch, kv_cache)
        # Only the last token of each sampling row needs the final norm and the lm_head.
        idx = batch.logits_indices
        if idx is not None:
            x, residual = x[idx], residual[idx]
        h, _ = self.ops.fused_add_rms_norm(x, residual, self.weights.norm, eps)
        return self._logits(h)  # [S, V]

    def forward_with_hidden(
        self, batch: ForwardBatch, kv_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits and every token's final normed hidden state [T, H] (what a
        multi-token-prediction layer reads)."""
        x = self._embed(batch.token_ids)
        at_once = (
            self._decode_layers(x, batch, kv_cache) if batch.decode_only and self.plain else None
        )
        x, residual = at_once if at_once is not None else self._layers(x, batch, kv_cache)
        h, _ = self.ops.fused_add_rms_norm(x, residual, self.weights.norm, self.config.rms_norm_eps)
        idx = batch.logits_indices
        last = h if idx is None else h[idx]
        return self._logits(last), h

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.ops.embedding(token_ids, self.weights.embed)  # [T, H]
        return x if self.embedding_scale is None else x * self.embedding_scale

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """[S, V] float32; soft-capped (Gemma 2) in the weights' dtype, as transformers."""
        logits = self.ops.linear(h, self.weights.lm_head)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _layers(
        self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers one by one: (x, residual) after the last."""
        residual: torch.Tensor | None = None
        for i, (layer, k_cache, v_cache) in enumerate(
            zip(self.weights.layers, kv_cache.k, kv_cache.v, strict=True)
        ):
            x, residual = self.decoder_layer(
                x, residual, layer, batch, k_cache, v_cache, self.config.window(i)
            )
        assert residual is not None
        return x, residual

    def decoder_layer(
        self,
        x: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,  # None: the first layer (x is the residual)
        layer: LayerWeights,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer: (its output, the residual stream before that output)."""
        eps = self.config.rms_norm_eps
        if residual is None:
            residual, h = x, self.ops.rms_norm(x, layer.attn_norm, eps)
        else:
            h, residual = self.ops.fused_add_rms_norm(x, residual, layer.attn_norm, eps)
        x = self.attention.forward(h, layer, batch, k_cache, v_cache, window)
        if layer.post_attn_norm is not None:
            x = self.ops.rms_norm(x, layer.post_attn_norm, eps)
        h, residual = self.ops.fused_add_rms_norm(x, residual, layer.ffn_norm, eps)
        if layer.moe is not None:
            assert self.config.moe is not None
            if self.experts is not None:
                return self.experts.forward(self.ops, self.config.moe, h, layer.moe), residual
            return moe_forward(self.ops, self.config.moe, h, layer.moe), residual
        out = self._gated_mlp(h, layer)
        if layer.post_ffn_norm is not None:
            out = self.ops.rms_norm(out, layer.post_ffn_norm, eps)
        return out, residual

    def mtp_layer(
        self,
        x: torch.Tensor,  # [T, H]
        layer: LayerWeights,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """One decoder layer outside the stack (a multi-token-prediction layer,
        DeepSeek-V3's): its output with the residual added."""
        x, residual = self.decoder_layer(x, None, layer, batch, k_cache, v_cache)
        return x + residual

    def _decode_layers(
        self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer of a decode step in one call where the backend has that path (the
        CPU backend's native one)."""
        if self.cpu_ops is None:
            return None
        layers = cast(list[LayerTensors], self.weights.layers)  # all plain: see self.plain
        return self.cpu_ops.decode_layers(
            x, layers, kv_cache.k, kv_cache.v, batch.positions,
            batch.slot_mapping, batch.block_tables, batch.context_lens, self.cos, self.sin,
            self.geometry,
        )  # fmt: skip

    def _gated_mlp(self, h: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """SwiGLU, or GeGLU (Gemma: gelu_pytorch_tanh(gate) * up, torch on any backend)."""
        assert layer.gate_up is not None and layer.down is not None  # a dense layer
        gate_up = self.ops.linear(h, layer.gate_up)  # [T, 2 I]
        if self.config.hidden_act == "silu":
            act = self.ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        return self.ops.linear(act, layer.down)  # [T, H]


def read_config(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """Qwen3's q/k norms and the sliding windows as transformers applies them: Mistral on
    every layer; Qwen2/Qwen3 only with use_sliding_window, on the layers layer_types names
    (by default those from max_window_layers on); Llama never."""
    arch = base.architecture
    refuse_options(arch, cfg, attention_bias=arch == "qwen2")
    if arch == "mistral" and cfg.get("layer_types"):
        raise ValueError("mistral: unsupported layer_types (alternating attention)")
    return replace(base, qk_norm=arch == "qwen3", layer_windows=_layer_windows(arch, cfg))


def _layer_windows(arch: str, cfg: dict[str, Any]) -> tuple[int | None, ...]:
    layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    if arch == "llama" or window is None:
        return ()
    if arch == "mistral":
        return (int(window),) * layers
    if not cfg.get("use_sliding_window"):
        return ()
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= int(cfg.get("max_window_layers", 28)) else "full"
        for i in range(layers)
    ]
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


# Llama and the families that differ from it only by configuration (q/k biases, q/k
# norms, windows), each also read from GGUF (`shared/gguf_arch.py`).
FAMILY = Family(
    name="llama", model_types=("llama", "mistral", "qwen2", "qwen3"), read_config=read_config
)
