"""A Llama-family decoder (GQA, RoPE, RMSNorm, SwiGLU) over a paged KV cache.

The families differ by configuration over the same pieces: q/k biases (Qwen2), per-head
q/k norms (Qwen3), sliding windows (Mistral), and a MoE feed-forward in place of the dense
MLP on some or all layers (`moe.moe_forward`: Qwen3-MoE, Mixtral).

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
import os
from dataclasses import dataclass, replace
from typing import cast

import torch

from spillway.kernels.cpu_decode_layers import Geometry, LayerTensors
from spillway.kernels.ops import KernelOps, TorchOps
from spillway.services.worker.expert_parallel import ExpertGroup
from spillway.services.worker.kv_cache import KVCache
from spillway.services.worker.mla import mla_output, mla_queries_and_latents
from spillway.services.worker.moe import moe_forward
from spillway.services.worker.rope import rope_tables, yarn_mscale
from spillway.services.worker.weights import LayerWeights, ModelWeights
from spillway.services.worker.window_attention import windowed_paged_attention
from spillway.shared.model_config import ModelConfig

log = logging.getLogger(__name__)
# Rows of warm_up's second pass: more than the few-row kernels take (cpu_matvec.MAX_ROWS).
WARM_UP_ROWS = 8


@dataclass
class ForwardBatch:
    """Index tensors for one step, built once and shared by every layer."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block_id * BS + offset
    block_tables: torch.Tensor  # [R, MB] int32
    context_lens: torch.Tensor  # [R] int32: tokens in the cache after this step
    query_start: torch.Tensor  # [R + 1] int32
    # [S] int64: the last token of each sampling row; None: every token's logits
    logits_indices: torch.Tensor | None
    max_query_len: int  # the longest row, known on the host (sizes kernel grids)
    # The longest context, known on the host (trims decode attention's split-K); None when
    # it must not be baked in (a CUDA graph replays for any context).
    max_context_len: int | None = None
    # One token per row (T == R): attention takes the `paged_decode_attention` fast path.
    decode_only: bool = False
    # Hybrid models: [R] int64, each row's slot in the state pool (`state_pool`), and
    # [R] bool, the rows whose first computed token is position 0 (their slot is zeroed
    # before the layers run). None for a model without state layers.
    state_slots: torch.Tensor | None = None
    state_fresh: torch.Tensor | None = None
    # Hybrid models' prefix caching: (row, token index within the row, snapshot), the
    # row's state copied to that snapshot once that token ran (host-side).
    state_takes: tuple[tuple[int, int, int], ...] = ()

    def to(self, device: torch.device) -> ForwardBatch:
        """The same batch with its tensors on `device` (one copy per tensor); itself where
        they are there already (a CPU step: nothing to copy, nothing to rebuild)."""
        if self.token_ids.device == device:  # every tensor of a batch shares one device
            return self
        idx = self.logits_indices
        return replace(
            self,
            token_ids=self.token_ids.to(device),
            positions=self.positions.to(device),
            slot_mapping=self.slot_mapping.to(device),
            block_tables=self.block_tables.to(device),
            context_lens=self.context_lens.to(device),
            query_start=self.query_start.to(device),
            logits_indices=None if idx is None else idx.to(device),
            state_slots=None if self.state_slots is None else self.state_slots.to(device),
            state_fresh=None if self.state_fresh is None else self.state_fresh.to(device),
        )


def configure_threads(device: torch.device, threads: int | None = None) -> int:
    """On the CPU: `threads` math threads, by default one per core this process may run
    on (its affinity, which a container or `taskset` may narrow). Returns the count."""
    if device.type != "cpu":
        return torch.get_num_threads()
    count = threads or available_cores()
    torch.set_num_threads(count)
    return count


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


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
        # The one-call decode loop runs plain Llama layers only.
        self.plain = not windows and all(layer.plain for layer in weights.layers)
        # Expert parallel: this rank's share of the MoE layers and their exchange
        # (`expert_parallel.ExpertGroup`); None: every expert here.
        self.experts: ExpertGroup | None = None
        mla = config.mla
        rotary_dim = mla.qk_rope_head_dim if mla else config.head_dim
        rope = config.extra.get("rope") or {"rope_type": "default"}
        self.cos, self.sin = rope_tables(
            rotary_dim, self.max_positions, config.rope_theta, weights.device, rope
        )
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # Latent attention scores with the full query-key head width (nope + rope).
        self.scale = (
            mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla else config.head_dim
        ) ** -0.5
        if mla and rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            # DeepSeek's softmax scale takes YaRN's magnitude correction squared.
            self.scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
        self.geometry = Geometry(
            config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps, self.scale
        )
        # The Triton kernels take power-of-two head widths; a latent's (kv_lora_rank + rope
        # dim: 576 for DeepSeek-V3) seldom is. Its attention then runs the plain torch ops,
        # which read lengths back to the host: no decode CUDA graphs for such a model.
        width = config.head_dim
        self.latent_ops: KernelOps = (
            TorchOps(native=None) if mla and ops.name != "torch" and width & (width - 1) else ops
        )
        # Windowed attention (`window_attention`, plain torch on any device) reads lengths
        # back to the host too.
        self.capturable = self.latent_ops is ops and not windows
        use_blocks = getattr(ops, "use_source_blocks", None)
        if use_blocks is not None and weights.blocks:
            use_blocks(weights.blocks)

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
        tune = getattr(self.ops, "tune_few_rows", None)
        if tune is not None and self.device.type == "cpu":
            choice = tune(projections)
            if choice is not None:
                log.info("few-row projections: one thread below %d KiB of weights", choice >> 10)
        forms = getattr(self.ops, "tune_many_rows", None)
        if forms is not None and self.device.type == "cpu":
            chosen = forms(projections)
            if chosen:
                log.info("many-row projections: %s", ", ".join(
                    f"{'x'.join(map(str, shape))} {form}" for shape, form in chosen.items()
                ))  # fmt: skip

    def verify_rows(self) -> int | None:
        """Positions of one sequence a decode step computes each as a step of that token
        alone would (the native few-row path, weights read once for all): a speculative
        verify of more may round differently. None: no such bound here."""
        rows = getattr(self.ops, "verify_rows", None)
        if rows is None or not self.plain or self.device.type != "cpu":
            return None
        w = self.weights
        layers = [(x.qkv, x.o, x.gate_up, x.down) for x in w.layers]
        with torch.inference_mode():
            return rows([t for group in layers for t in group if t is not None] + [w.lm_head])

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Logits [S, V] float32 for the sampling rows ([T, V] when batch.logits_indices is
        None); writes this step's K/V to the cache. Reads nothing back to the host."""
        eps = self.config.rms_norm_eps
        x = self.ops.embedding(batch.token_ids, self.weights.embed)  # [T, H]
        at_once = (
            self._decode_layers(x, batch, kv_cache) if batch.decode_only and self.plain else None
        )
        x, residual = at_once if at_once is not None else self._layers(x, batch, kv_cache)
        # Only the last token of each sampling row needs the final norm and the lm_head.
        idx = batch.logits_indices
        if idx is not None:
            x, residual = x[idx], residual[idx]
        h, _ = self.ops.fused_add_rms_norm(x, residual, self.weights.norm, eps)
        return self.ops.linear(h, self.weights.lm_head).float()  # [S, V]

    def forward_with_hidden(
        self, batch: ForwardBatch, kv_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits and every token's final normed hidden state [T, H] (what a
        multi-token-prediction layer reads)."""
        x = self.ops.embedding(batch.token_ids, self.weights.embed)
        at_once = (
            self._decode_layers(x, batch, kv_cache) if batch.decode_only and self.plain else None
        )
        x, residual = at_once if at_once is not None else self._layers(x, batch, kv_cache)
        h, _ = self.ops.fused_add_rms_norm(x, residual, self.weights.norm, self.config.rms_norm_eps)
        idx = batch.logits_indices
        last = h if idx is None else h[idx]
        return self.ops.linear(last, self.weights.lm_head).float(), h

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
        x = self._attention(h, layer, batch, k_cache, v_cache, window)
        h, residual = self.ops.fused_add_rms_norm(x, residual, layer.ffn_norm, eps)
        if layer.moe is not None:
            assert self.config.moe is not None
            if self.experts is not None:
                return self.experts.forward(self.ops, self.config.moe, h, layer.moe), residual
            return moe_forward(self.ops, self.config.moe, h, layer.moe), residual
        return self._swiglu(h, layer), residual

    def _decode_layers(
        self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer of a decode step in one call where the backend has that path."""
        layers = cast(list[LayerTensors], self.weights.layers)  # all plain: see self.plain
        return self.ops.decode_layers(
            x, layers, kv_cache.k, kv_cache.v, batch.positions,
            batch.slot_mapping, batch.block_tables, batch.context_lens, self.cos, self.sin,
            self.geometry,
        )  # fmt: skip

    def _attention(
        self,
        h: torch.Tensor,  # [T, H]
        layer: LayerWeights,
        batch: ForwardBatch,
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        c = self.config
        t = h.shape[0]
        if layer.mla is not None:
            return self._latent_attention(h, layer, batch, k_cache)
        qkv = self.ops.linear(h, layer.qkv, layer.qkv_bias)  # [T, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if layer.q_norm is not None and layer.k_norm is not None:  # over each head's D
            eps = c.rms_norm_eps
            q = self.ops.rms_norm(q.reshape(-1, c.head_dim), layer.q_norm, eps)
            k = self.ops.rms_norm(k.reshape(-1, c.head_dim), layer.k_norm, eps)
        q = q.reshape(t, c.num_heads, c.head_dim)  # [T, Hq, D]
        k = k.reshape(t, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
        v = v.view(t, c.num_kv_heads, c.head_dim)
        self.ops.rotary(q, k, batch.positions, self.cos, self.sin)
        self.ops.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = self._attend(q, batch, k_cache, v_cache, window)  # [T, Hq, D]
        return self.ops.linear(out.reshape(t, self.q_size), layer.o)  # [T, H]

    def _latent_attention(
        self, h: torch.Tensor, layer: LayerWeights, batch: ForwardBatch, cache: torch.Tensor
    ) -> torch.Tensor:
        """DeepSeek-V3's attention: the cache's one plane is both K and V (`mla`)."""
        c, w = self.config, layer.mla
        assert c.mla is not None and w is not None
        qkv = self.ops.linear(h, layer.qkv)  # [T, q + R + dr]
        q, kv = mla_queries_and_latents(
            self.ops, c.mla, c.num_heads, qkv, w, batch.positions, self.cos, self.sin
        )  # [T, Hq, R + dr], [T, 1, R + dr]
        self.latent_ops.store_kv(kv, kv, cache, cache, batch.slot_mapping)
        out = self._attend(q, batch, cache, cache, None, self.latent_ops)  # [T, Hq, R + dr]
        return self.ops.linear(mla_output(c.mla, out, w), layer.o)  # [T, H]

    def _attend(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        window: int | None,
        ops: KernelOps | None = None,
    ) -> torch.Tensor:
        """Paged attention of this step's queries, as the batch and the window call for."""
        ops = ops or self.ops
        if window is not None and (batch.max_context_len or self.max_positions) > window:
            out = windowed_paged_attention(
                q, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.query_start,
                self.scale, window,
            )  # fmt: skip
        elif batch.decode_only:  # T == R: row r's single query is q[r]
            out = ops.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                batch.block_tables,
                batch.context_lens,
                self.scale,
                max_context_len=batch.max_context_len,
            )  # [R, Hq, D]
        else:
            out = ops.paged_attention(
                q,
                k_cache,
                v_cache,
                batch.block_tables,
                batch.context_lens,
                batch.query_start,
                self.scale,
                max_query_len=batch.max_query_len,
            )  # [T, Hq, D]
        return out

    def _swiglu(self, h: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        assert layer.gate_up is not None and layer.down is not None  # a dense layer
        gate_up = self.ops.linear(h, layer.gate_up)  # [T, 2 I]
        return self.ops.linear(self.ops.silu_mul(gate_up), layer.down)  # [T, H]
