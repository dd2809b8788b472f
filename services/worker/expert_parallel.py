"""Expert parallel: one worker as a group of N ranks over `torch.distributed`.

Attention, norms, embeddings and the lm_head are replicated (every rank holds the whole
batch and its own copy of the KV cache, written by the same plan); each MoE layer's
routed experts are sharded, rank r holding experts [r E/N, (r+1) E/N). The router runs on
every rank (replicated, float32), so every rank knows every token's experts. Two
exchanges combine the experts' outputs:

    all_reduce   every rank runs its local experts over the (token, k) pairs routed to
                 them, scatters the results into a [T, H] float32 buffer (zeros
                 elsewhere) and an all_reduce sums the buffers.
    all_to_all   rank r owns the tokens [r T/N, (r+1) T/N): it sends each of their
                 pairs to the rank holding the expert (all_to_all_single), gets the
                 weighted outputs back the same way, sums them per token, and an
                 all_gather gives every rank the whole [T, H].

Collectives are matched by the order in which they are issued, so every rank issues the
same ones in the same order every layer, a rank with no pairs for its experts included
(it sends and receives empty splits, or adds zeros).

A collective that fails (a peer died: gloo sees its socket close) or does not finish
within the group's timeout breaks the group for good: the rank says so and exits
(`on_broken`), since nothing issued on a broken group can be trusted to match again. A
watchdog thread covers backends whose collectives may block past their own timeout.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from spillway.kernels.ops import KernelOps
from spillway.services.worker.layers.moe import (
    MoEWeights,
    experts_forward,
    route,
    shared_experts,
)
from spillway.shared.expert_parallel import expert_range
from spillway.shared.model_config import MoEConfig

log = logging.getLogger(__name__)

Exchange = Literal["all_reduce", "all_to_all"]
EXCHANGES: tuple[Exchange, ...] = ("all_reduce", "all_to_all")


class GroupBroken(RuntimeError):
    """A collective of the group failed or timed out: the group cannot go on."""


@dataclass
class ExchangeCounters:
    """What the MoE layers of one step exchanged (reset at each step)."""

    num_experts: int
    bytes: int = 0  # sent by this rank to the others
    seconds: float = 0.0  # inside the collectives
    # Routed (token, k) pairs per expert, summed on the device: read once per step.
    _tokens: torch.Tensor | None = None

    def count(self, topk_ids: torch.Tensor) -> None:
        counts = torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
        self._tokens = counts if self._tokens is None else self._tokens + counts

    @property
    def expert_tokens(self) -> list[int]:
        if self._tokens is None:
            return [0] * self.num_experts
        return [int(n) for n in self._tokens.tolist()]


def token_range(num_tokens: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi): the tokens whose experts' outputs rank `rank` gathers (all_to_all)."""
    per = -(-num_tokens // size)
    return min(rank * per, num_tokens), min((rank + 1) * per, num_tokens)


class ExpertGroup:
    """This rank's place in the group and the MoE layers' exchange."""

    def __init__(
        self,
        rank: int,
        size: int,
        exchange: Exchange = "all_reduce",
        group: Any = None,
        timeout_s: float = 5.0,
        on_broken: Callable[[str], None] | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        if exchange not in EXCHANGES:
            raise ValueError(f"unknown expert exchange {exchange!r}: one of {EXCHANGES}")
        self.rank = rank
        self.size = size
        self.exchange = exchange
        self.group = group
        self.timeout_s = timeout_s
        self.on_broken = on_broken or _exit_broken
        self.timer = timer
        self.counters = ExchangeCounters(0)
        self.broken = False
        self._pending_since: float | None = None
        self._watchdog: threading.Thread | None = None

    # --- weights -------------------------------------------------------------------------

    def shard(self, layers: list[Any]) -> None:
        """Keeps only this rank's experts of every MoE layer (`layer.moe`)."""
        for layer in layers:
            moe: MoEWeights | None = getattr(layer, "moe", None)
            if moe is None or moe.w_gate_up.numel() == 0:  # dense (a hybrid's MLP alone)
                continue
            lo, hi = expert_range(moe.w_gate_up.shape[0], self.rank, self.size)
            moe.w_gate_up = moe.w_gate_up[lo:hi].clone()
            moe.w_down = moe.w_down[lo:hi].clone()

    # --- steps -----------------------------------------------------------------------------

    def start_step(self, num_experts: int) -> None:
        self.counters = ExchangeCounters(num_experts)

    def forward(self, ops: KernelOps, config: MoEConfig, h: torch.Tensor, w: MoEWeights):
        """The MoE feed-forward of `moe.moe_forward`, its routed experts spread over the
        group. h [T, H] -> [T, H]."""
        logits = F.linear(h.float(), w.router.float())  # [T, E], as moe_forward
        topk_ids, topk_weights = route(config, logits, w.correction_bias)
        num_experts = config.num_experts
        if self.counters.num_experts != num_experts:
            self.counters = ExchangeCounters(num_experts)
        self.counters.count(topk_ids)
        if self.size == 1:  # every expert here: the one-process layer, counted
            return experts_forward(ops, h, w, topk_ids, topk_weights)
        if self.exchange == "all_reduce":
            out = self._all_reduce(ops, h, w, topk_ids, topk_weights, num_experts)
        else:
            out = self._all_to_all(ops, h, w, topk_ids, topk_weights, num_experts)
        out = out.to(h.dtype)
        shared = shared_experts(ops, h, w)
        return out if shared is None else out + shared

    def _all_reduce(self, ops, h, w, topk_ids, topk_weights, num_experts) -> torch.Tensor:
        t, k = topk_ids.shape
        token_of = torch.arange(t, device=h.device).repeat_interleave(k)
        flat_ids, flat_w = topk_ids.reshape(-1), topk_weights.reshape(-1).float()
        lo, hi = expert_range(num_experts, self.rank, self.size)
        sel = ((flat_ids >= lo) & (flat_ids < hi)).nonzero(as_tuple=True)[0]
        out = torch.zeros(t, h.shape[1], dtype=torch.float32, device=h.device)
        if sel.numel():
            y = self._experts(ops, h[token_of[sel]], w, flat_ids[sel] - lo, flat_w[sel])
            out.index_add_(0, token_of[sel], y)
        # A ring all_reduce sends 2 (N-1)/N of the buffer from each rank.
        sent = 2 * (self.size - 1) * out.numel() * out.element_size() // self.size
        with self._collective(sent):
            dist.all_reduce(out, group=self.group)
        return out

    def _all_to_all(self, ops, h, w, topk_ids, topk_weights, num_experts) -> torch.Tensor:
        n, (t, k) = self.size, topk_ids.shape
        hidden = h.shape[1]
        per_rank = num_experts // n
        expert_range(num_experts, self.rank, n)  # checks the division
        t_lo, t_hi = token_range(t, self.rank, n)
        # My tokens' pairs, sorted by the rank holding their expert.
        ids = topk_ids[t_lo:t_hi].reshape(-1)
        weights = topk_weights[t_lo:t_hi].reshape(-1).float()
        token_of = torch.arange(t_lo, t_hi, device=h.device).repeat_interleave(k)
        dest = ids // per_rank
        order = torch.argsort(dest, stable=True)
        ids, weights, token_of, dest = ids[order], weights[order], token_of[order], dest[order]
        send_counts = torch.bincount(dest, minlength=n)  # on the device, as NCCL needs
        recv_counts = torch.empty_like(send_counts)
        with self._collective(8 * (n - 1)):
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        rows = h[token_of]  # [P, H]
        meta = torch.stack([(ids % per_rank).float(), weights], dim=1)  # [P, 2]
        got_rows = h.new_empty(sum(recvs), hidden)
        got_meta = meta.new_empty(sum(recvs), 2)
        others = sum(c for r, c in enumerate(sends) if r != self.rank)
        sent = others * (hidden * h.element_size() + 2 * meta.element_size())
        with self._collective(sent):
            dist.all_to_all_single(got_rows, rows, recvs, sends, group=self.group)
            dist.all_to_all_single(got_meta, meta, recvs, sends, group=self.group)
        y = torch.zeros(sum(recvs), hidden, dtype=torch.float32, device=h.device)
        if got_rows.shape[0]:
            y = self._experts(ops, got_rows, w, got_meta[:, 0].long(), got_meta[:, 1])
        back = y.new_empty(sum(sends), hidden)
        others_back = sum(c for r, c in enumerate(recvs) if r != self.rank)
        with self._collective(others_back * hidden * y.element_size()):
            dist.all_to_all_single(back, y, sends, recvs, group=self.group)
        mine = torch.zeros(t_hi - t_lo, hidden, dtype=torch.float32, device=h.device)
        mine.index_add_(0, token_of - t_lo, back)
        # Every rank needs every token (attention is replicated): gather the owners'
        # sums, padded to one size.
        per = -(-t // n)
        padded = torch.zeros(per, hidden, dtype=torch.float32, device=h.device)
        padded[: mine.shape[0]] = mine
        parts = [torch.empty_like(padded) for _ in range(n)]
        with self._collective((n - 1) * padded.numel() * padded.element_size()):
            dist.all_gather(parts, padded, group=self.group)
        return torch.cat(parts)[:t]

    @staticmethod
    def _experts(ops, x, w: MoEWeights, local_ids, weights) -> torch.Tensor:
        """Each row through its one (local) expert, weighted: [P, H] float32."""
        y = ops.fused_experts(x, w.w_gate_up, w.w_down, local_ids[:, None], weights[:, None])
        return y.float()

    # --- plans and tokens between ranks ----------------------------------------------------

    def share(self, obj: Any) -> Any:
        """Rank 0's object on every rank (broadcast in the group's order)."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        with self._collective(0):
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def union(self, items: list[str]) -> list[str]:
        """Every rank's items, once each, in rank order: the ranks agree on a set."""
        if self.size == 1:
            return items
        boxes: list[Any] = [None] * self.size
        with self._collective(0):
            dist.all_gather_object(boxes, items, group=self.group)
        return list(dict.fromkeys(x for box in boxes for x in box))

    # --- failure ---------------------------------------------------------------------------

    @contextmanager
    def _collective(self, num_bytes: int) -> Iterator[None]:
        if self.broken:
            raise GroupBroken("the expert-parallel group is broken")
        start = self.timer()
        self._pending_since = time.monotonic()
        try:
            yield
        except Exception as e:
            self._break(f"collective failed on rank {self.rank}: {type(e).__name__}: {e}")
            raise GroupBroken(str(e)) from e
        finally:
            self._pending_since = None
        self.counters.seconds += self.timer() - start
        self.counters.bytes += num_bytes

    def start_watchdog(self, interval_s: float = 0.2) -> None:
        """A thread that breaks the group when a collective stays pending past the
        timeout (with a margin for the backend's own timeout to fire first)."""

        def watch() -> None:
            while not self.broken:
                time.sleep(interval_s)
                since = self._pending_since
                if since is not None and time.monotonic() - since > 1.5 * self.timeout_s + 1:
                    self._break(f"a collective hung for over {1.5 * self.timeout_s + 1:g}s")

        self._watchdog = threading.Thread(target=watch, name="ep-watchdog", daemon=True)
        self._watchdog.start()

    def abandon(self, why: str) -> None:
        """This rank cannot keep step with the others (its step failed half-way)."""
        self._break(why)

    def _break(self, why: str) -> None:
        if self.broken:
            return
        self.broken = True
        log.error("expert-parallel group broken: %s", why)
        self.on_broken(why)


def _exit_broken(why: str) -> None:
    """The default on a broken group: this process cannot serve, and a process blocked in
    a collective may not unwind; it leaves at once (the scheduler gives up the worker when
    its heartbeats stop, the supervisor starts the group again)."""
    logging.shutdown()
    os._exit(3)
