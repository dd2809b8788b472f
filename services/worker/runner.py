"""The worker's core: carries out step plans on the model and the KV cache (no NATS).

A plan is applied in its field order (forget finished sequences, take new ones afresh,
append blocks to running ones), then all its rows run in one batched forward:

    tokens    | row 0 (prefill chunk)  | row 1 | row 2 | ...   T tokens, packed
    positions | s0, s0+1, ..., s0+n0-1 |  s1   |  s2   |       start_pos + i
    sampled   |                     ^  |   ^   |       |       last token of sampling rows

A step whose rows all decode (one token each) replays a captured CUDA graph when the runner
has one for its size (`capture_decode_graphs`); other steps run eagerly.

Before the sequence table changes, KV leaves (spills of preemption victims, finished
blocks for the shared prefix tier: their blocks may be reused by this very step); after
it, KV comes in (swap-in restores, prefix-tier loads). A sequence whose KV could not be
brought in is reported lost and its row skipped; the scheduler recomputes it.

Run-ahead rows (`feed_last`) take the token this runner sampled last for their sequence.

A hybrid model (recurrent layers beside attention) keeps each running sequence's state in
the slot of the state pool the scheduler named (`NewSequence.state_slot`); so does a
hybrid draft model, its layers after the target's in the same pool (a dense target with
a hybrid draft keeps state slots for the draft alone). The runner
remembers, per slot, whose state it holds and after how many tokens: a row starting at 0
zeroes its slot, any other row must continue exactly that state, or the sequence is
reported lost (a failed or voided step may have moved it) and the scheduler recomputes
it. A spill carries the slot's state only as it stands at the spill's tokens.

A wrong plan (unknown sequence, block or token out of range, too few blocks) is rejected
whole with a 400 StepResult and leaves the runner's state as it was. A forward that runs
out of memory is reported as `out_of_memory` (the scheduler sheds one victim and retries).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from spillway.kernels.cpu.ops import CpuAbilities
from spillway.services.worker.cuda_graphs import Capture, DecodeGraphs
from spillway.services.worker.draft_model import DraftModelDrafter
from spillway.services.worker.draft_states import DraftStates
from spillway.services.worker.expert_parallel import ExpertGroup
from spillway.services.worker.forward_batch import ForwardBatch
from spillway.services.worker.kv_cache import (
    KVCache,
    block_table_tensor,
    blocks_needed,
    slot_mapping_tensor,
)
from spillway.services.worker.kv_transfer import KVTransfer, TransferCounters
from spillway.services.worker.models.hybrid import HybridModel
from spillway.services.worker.models.llama import LlamaModel
from spillway.services.worker.mtp import MtpDrafter
from spillway.services.worker.sampling_state import SamplingStates
from spillway.services.worker.speculative import (
    as_decode_rows,
    extra_logprobs,
    row_drafts,
    verify_drafts,
)
from spillway.services.worker.state_pool import StatePool
from spillway.shared.protocol import (
    OUT_OF_MEMORY_CODE,
    ErrorInfo,
    KVRestore,
    KVSpill,
    RowResult,
    SamplingParams,
    SpillOutcome,
    StepPlan,
    StepResult,
    StepRow,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SequenceState:
    block_ids: tuple[int, ...]
    sampling: SamplingParams
    state_slot: int | None = None  # a hybrid model's state pool slot


@dataclass(frozen=True)
class StepPhases:
    """Where a step's time went on the worker (seconds); forward_s includes sampling."""

    prepare_s: float
    forward_s: float
    sample_s: float
    accept_s: float | None = None  # deciding which drafts stand (a step with drafts)


class PlanError(ValueError):
    """A plan the runner cannot carry out as given (the scheduler's mistake)."""


@dataclass(frozen=True)
class KVIo:
    """One spill or restore of a step: what the worker's trace spans are made of."""

    kind: Literal["spill", "restore"]
    seq_id: str
    traceparent: str | None
    ok: bool
    num_bytes: int
    start_ns: int
    end_ns: int


def is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(e).lower()
    return "out of memory" in text or "can't allocate memory" in text


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        timer: Callable[[], float] = time.perf_counter,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        kv_transfer: KVTransfer | None = None,
        sampling: SamplingStates | None = None,
        state_pool: StatePool | None = None,
        state_snapshots: StatePool | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        # The recurrent states (a hybrid target's, a hybrid draft's after them), and per
        # slot (sequence, tokens consumed): every model's state in a slot stands there.
        self.state_pool = state_pool
        self.state_tokens: dict[int, tuple[str, int]] = {}
        # The target's own layers of the pool and the snapshots (None: a dense target).
        self.target_states: StatePool | None = None
        self.target_snapshots: StatePool | None = None
        if state_pool is not None and isinstance(model, HybridModel):
            n = len(model.layers)
            self.target_states = state_pool.layers(0, n)
            if state_snapshots is not None:
                self.target_snapshots = state_snapshots.layers(0, n)
        # Snapshots of states at block boundaries (prefix caching); the scheduler names the
        # first num_state_snapshots of them, the rest keep states at draft positions.
        self.state_snapshots = state_snapshots
        self.num_state_snapshots = 0 if state_snapshots is None else state_snapshots.num_slots
        self.draft_states: DraftStates | None = None
        if kv_transfer is not None:
            kv_transfer.state_pool = state_pool
            kv_transfer.state_snapshots = state_snapshots
        # Per-sequence sampling state (penalty counts, regions, grammar matchers).
        self.sampling = sampling or SamplingStates(model.config.eos_token_ids)
        # The kernels' native CPU argmax and race uniforms where they built them (torch's
        # argmax keeps an index per compared value, its uniforms take a dozen int32 passes
        # over a step's [S, V]: several times slower).
        ops = getattr(model, "ops", None)
        if isinstance(ops, CpuAbilities):
            if ops.argmax is not None:
                self.sampling.argmax = ops.argmax
            if ops.uniforms is not None:
                self.sampling.uniforms = ops.uniforms
        self.timer = timer
        self.wall_clock_ns = wall_clock_ns
        self.kv_transfer = kv_transfer  # None: no spill store (spills fail, loads lose)
        self.kv_layout = ""  # see kv_layout(); set by load_runner
        # `--speculative mtp`: the model's MTP layer drafts after each sampled row.
        self.mtp: MtpDrafter | None = None
        # `--speculative draft`: a small model with its own cache drafts likewise.
        self.draft: DraftModelDrafter | None = None
        self.sequences: dict[str, SequenceState] = {}
        # Each sequence's last sampled token, which a run-ahead row feeds.
        self.last_token: dict[str, int] = {}
        self.graphs: DecodeGraphs | None = None  # see capture_decode_graphs
        self._decode_kept: _KeptDecodeBatch | None = None  # see _decode_batch
        self.num_steps = 0
        # --max-model-len: the longest sequence served (None: the model's positions).
        self.max_model_len_cap: int | None = None
        # Wall-clock (start, end) ns of the last forward, for the service's trace spans.
        self.last_forward_ns: tuple[int, int] = (0, 0)
        # The last step's spills and restores, one by one, for the same spans.
        self.last_kv_io: list[KVIo] = []

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def max_model_len(self) -> int:
        cap = self.max_model_len_cap or self.model.max_positions
        return min(self.model.max_positions, self.kv_cache.num_slots, cap)

    @property
    def max_verify_tokens(self) -> int:
        """Positions one verifying row may hold (`WorkerInfo.max_verify_tokens`; 0: any)."""
        if not isinstance(self.model, LlamaModel):
            return 0
        return self.model.verify_rows() or 0

    @property
    def experts(self) -> ExpertGroup | None:
        """The expert-parallel group this runner is a rank of (None: a worker alone)."""
        return self.model.experts

    @property
    def follower(self) -> bool:
        """A rank other than 0: it runs rank 0's plans, and samples and replies nothing."""
        return self.model.experts is not None and self.model.experts.rank != 0

    def execute(self, plan: StepPlan) -> StepResult:
        group = self.model.experts
        if group is not None and group.rank == 0:
            # Every rank runs every plan, in this order (collectives match by order).
            group.share(plan)
        try:
            sequences = self._applied(plan)
            self._check_kv_orders(plan)
            self._check_rows(plan.rows, sequences, {n.seq_id for n in plan.new_seqs})
            self._check_snapshots(plan, sequences)
        except PlanError as e:
            error = ErrorInfo(
                status=400, message=str(e), type="invalid_request_error", code="invalid_plan"
            )
            return StepResult(step_id=plan.step_id, error=error)
        result = StepResult(step_id=plan.step_id)
        if self.kv_transfer is not None:
            self.kv_transfer.counters = TransferCounters()
        self.last_kv_io = []
        # Fields are set only when they differ from their defaults: a pydantic assignment
        # costs about a microsecond, and a batch-1 step's host work is on its critical path.
        if plan.spills:
            result.spills = [self._spill(order) for order in plan.spills]
        if self.kv_transfer is not None and not self.follower:
            self.kv_transfer.store_prefix(plan.prefix_stores)
        for seq_id in [*plan.finished_seq_ids, *(n.seq_id for n in plan.new_seqs)]:
            self.last_token.pop(seq_id, None)
        self.sequences = sequences
        self.sampling.apply(plan)
        lost_seq_ids = self._bring_kv_in(plan)
        self._copy_snapshots(plan)
        lost_seq_ids += self._states_lost(plan.rows, set(lost_seq_ids))
        if group is not None:  # every rank runs the same rows: a row lost on one is lost
            lost_seq_ids = group.union(lost_seq_ids)
        if lost_seq_ids:
            result.lost_seq_ids = lost_seq_ids
        self._count_transfers(result)
        lost = set(lost_seq_ids)
        rows = [row for row in plan.rows if row.seq_id not in lost]
        if not rows:
            return result
        try:
            result.rows, phases = self._run(rows)
        except Exception as e:  # a device failure: report it, keep serving
            if group is not None and group.size > 1:
                # The other ranks may be inside this step's collectives: whatever this rank
                # issued next would be matched with them. The group cannot go on.
                group.abandon(f"step {plan.step_id} failed: {type(e).__name__}: {e}")
            for row in rows:  # their run-ahead rows must not feed a stale token
                self.last_token.pop(row.seq_id, None)
                self._forget_state(row.seq_id)  # the layers may have moved it partway
            if is_out_of_memory(e):
                log.warning("step %d ran out of memory (%d rows)", plan.step_id, len(rows))
                result.error = ErrorInfo(
                    status=503, message=f"out of memory: {e}"[:500], code=OUT_OF_MEMORY_CODE
                )
            else:
                log.exception("step %d failed", plan.step_id)
                result.error = ErrorInfo(
                    status=500, message=f"forward failed: {type(e).__name__}: {e}"
                )
            return result
        for out in result.rows:
            self.last_token[out.seq_id] = (out.extra_token_ids or [out.token_id])[-1]
        if self.state_pool is not None:
            extra = {out.seq_id: len(out.extra_token_ids) for out in result.rows}
            for row in rows:
                slot = self.sequences[row.seq_id].state_slot
                assert slot is not None
                # A row with drafts: its state stands after the accepted ones.
                end = row.start_pos + row_length(row) - row.num_draft_tokens
                self.state_tokens[slot] = (row.seq_id, end + extra.get(row.seq_id, 0))
        self.num_steps += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "step %d: %d rows, %d tokens; prepare %.2f ms, forward %.2f ms, sampling %.2f ms",
                plan.step_id,
                len(rows),
                sum(row_length(row) for row in rows),
                1e3 * phases.prepare_s,
                1e3 * (phases.forward_s - phases.sample_s),
                1e3 * phases.sample_s,
            )
        result.forward_s = phases.forward_s
        result.prepare_s = phases.prepare_s
        result.sample_s = phases.sample_s
        result.accept_s = phases.accept_s
        if group is not None:
            c = group.counters
            result.expert_tokens = c.expert_tokens
            result.ep_exchange_bytes, result.ep_exchange_s = c.bytes, c.seconds
            if group.size > 1 and log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "step %d: expert exchange (%s) %d bytes, %.2f ms; tokens per expert %s",
                    plan.step_id, group.exchange, c.bytes, 1e3 * c.seconds, c.expert_tokens,
                )  # fmt: skip
        return result

    def forget_all(self) -> None:
        """Drops every sequence and what goes with it (run-ahead tokens, sampling state):
        they belong to a scheduler this worker no longer serves."""
        self.execute(StepPlan(step_id=0, finished_seq_ids=list(self.sequences)))

    # --- KV to and from the spill store ---------------------------------------------------

    def _spill(self, order: KVSpill) -> SpillOutcome:
        if self.follower:  # rank 0 writes the group's spills (every rank holds the same KV)
            return SpillOutcome(seq_id=order.seq_id, spill_id=order.spill_id, ok=True)
        if self.kv_transfer is None:
            return SpillOutcome(
                seq_id=order.seq_id, spill_id=order.spill_id, ok=False, error="no spill store"
            )
        if order.state_slot is not None and (
            self.state_pool is None
            or self.state_tokens.get(order.state_slot) != (order.seq_id, order.state_tokens)
        ):
            # The state is not the one at the spill's tokens: it would not match the blocks.
            return SpillOutcome(
                seq_id=order.seq_id,
                spill_id=order.spill_id,
                ok=False,
                error="the recurrent state is not at the spilled tokens",
            )
        start_ns = self.wall_clock_ns()
        outcome = self.kv_transfer.spill(order, self.drafter_caches())
        self.last_kv_io.append(
            KVIo("spill", order.seq_id, order.traceparent, outcome.ok, outcome.num_bytes,
                 start_ns, self.wall_clock_ns())
        )  # fmt: skip
        return outcome

    def _restore(self, order: KVRestore) -> bool:
        if self.kv_transfer is None:
            return False
        before = self.kv_transfer.counters.restored_bytes
        start_ns = self.wall_clock_ns()
        ok = self.kv_transfer.restore(order, self.drafter_caches())
        if ok and order.state_slot is not None:
            self.state_tokens[order.state_slot] = (order.seq_id, order.state_tokens)
        num_bytes = self.kv_transfer.counters.restored_bytes - before
        self.last_kv_io.append(
            KVIo("restore", order.seq_id, order.traceparent, ok, num_bytes,
                 start_ns, self.wall_clock_ns())
        )  # fmt: skip
        return ok

    def drafter_caches(self) -> list[KVCache]:
        """The drafter's caches under the target's block ids: they leave and come back
        with the target's blocks."""
        if self.mtp is not None:
            return [self.mtp.cache]
        if self.draft is not None:
            return [self.draft.cache]
        return []

    def _bring_kv_in(self, plan: StepPlan) -> list[str]:
        """Restores and prefix loads; the sequences whose KV could not be read."""
        lost: list[str] = []
        for restore in plan.restores:
            if not self._restore(restore):
                lost.append(restore.seq_id)
        for load in plan.prefix_loads:
            if self.kv_transfer is None or not self.kv_transfer.load_prefix(load):
                lost.append(load.seq_id)
            elif load.state_slot is not None:
                self.state_tokens[load.state_slot] = (load.seq_id, load.state_tokens)
        return lost

    def _copy_snapshots(self, plan: StepPlan) -> None:
        """Prefix hits of a hybrid model: each snapshot into its sequence's slot."""
        for copy in plan.state_copies:
            slot = self.sequences[copy.seq_id].state_slot
            assert self.state_pool is not None and self.state_snapshots is not None
            assert slot is not None
            self.state_pool.copy_slot(self.state_snapshots, copy.snapshot, slot)
            self.state_tokens[slot] = (copy.seq_id, copy.num_tokens)

    def _states_lost(self, rows: Sequence[StepRow], lost: set[str]) -> list[str]:
        """Rows whose sequence's state is not where the row starts (the scheduler
        recomputes them); a row starting at 0 takes its slot afresh."""
        if self.state_pool is None:
            return []
        out = []
        for row in rows:
            slot = self.sequences[row.seq_id].state_slot
            if row.seq_id in lost or slot is None or row.start_pos == 0:
                continue
            if self.state_tokens.get(slot) != (row.seq_id, row.start_pos):
                log.warning("%s: recurrent state not at %d tokens", row.seq_id, row.start_pos)
                out.append(row.seq_id)
        return out

    def _forget_state(self, seq_id: str) -> None:
        state = self.sequences.get(seq_id)
        if state is not None and state.state_slot is not None:
            self.state_tokens.pop(state.state_slot, None)

    def _count_transfers(self, result: StepResult) -> None:
        if self.kv_transfer is None:
            return
        c = self.kv_transfer.counters
        if not (c.bytes or c.seconds or c.restored_bytes or c.restore_s):
            return  # the defaults: no traffic this step
        result.kv_io_bytes, result.kv_io_s = c.bytes, c.seconds
        result.restored_bytes, result.restore_s = c.restored_bytes, c.restore_s

    def _check_kv_orders(self, plan: StepPlan) -> None:
        for spill in plan.spills:
            self._check_blocks(spill.seq_id, spill.block_ids)
        self._check_blocks("prefix tier", [b.block_id for b in plan.prefix_stores])
        for restore in plan.restores:
            self._check_blocks(restore.seq_id, restore.block_ids)
        for load in plan.prefix_loads:
            self._check_blocks(load.seq_id, [b.block_id for b in load.blocks])

    # --- plan application ----------------------------------------------------------------

    def _applied(self, plan: StepPlan) -> dict[str, SequenceState]:
        """The sequence table after the plan's bookkeeping; self.sequences is untouched."""
        sequences = dict(self.sequences)
        for seq_id in plan.finished_seq_ids:
            sequences.pop(seq_id, None)
        for new in plan.new_seqs:
            self._check_blocks(new.seq_id, new.block_ids)
            self._check_slot(new.seq_id, new.state_slot)
            sequences[new.seq_id] = SequenceState(
                tuple(new.block_ids), new.sampling, new.state_slot
            )
        for update in plan.updated_seqs:
            state = sequences.get(update.seq_id)
            if state is None:
                raise PlanError(f"update for unknown sequence {update.seq_id!r}")
            self._check_blocks(update.seq_id, update.new_block_ids)
            kept = state.block_ids
            if update.num_kept_blocks is not None:  # rejected drafts' blocks went back
                kept = kept[: update.num_kept_blocks]
            sequences[update.seq_id] = SequenceState(
                kept + tuple(update.new_block_ids), state.sampling, state.state_slot
            )
        return sequences

    def _check_snapshots(self, plan: StepPlan, sequences: dict[str, SequenceState]) -> None:
        count = self.num_state_snapshots
        wanted = [c.snapshot for c in plan.state_copies]
        wanted += [s.snapshot for row in plan.rows for s in row.state_snapshots]
        bad = [s for s in wanted if not 0 <= s < count]
        if bad:
            raise PlanError(f"state snapshots {bad[:5]} outside the {count} this worker keeps")
        for copy in plan.state_copies:
            if copy.seq_id not in sequences:
                raise PlanError(f"state copy for unknown sequence {copy.seq_id!r}")
        for row in plan.rows:
            if any(s.num_tokens > row_length(row) for s in row.state_snapshots):
                raise PlanError(f"row for {row.seq_id!r}: a snapshot past its tokens")

    def _check_slot(self, seq_id: str, slot: int | None) -> None:
        if self.state_pool is None:
            return
        if slot is None or not 0 <= slot < self.state_pool.num_slots:
            raise PlanError(
                f"sequence {seq_id!r}: state slot {slot} outside 0..{self.state_pool.num_slots - 1}"
            )

    def _check_blocks(self, seq_id: str, block_ids: Sequence[int]) -> None:
        num_blocks = self.kv_cache.num_blocks
        bad = [b for b in block_ids if not 0 <= b < num_blocks]
        if bad:
            raise PlanError(f"sequence {seq_id!r}: block ids {bad[:5]} outside 0..{num_blocks - 1}")

    def _check_rows(
        self, rows: Sequence[StepRow], sequences: dict[str, SequenceState], new: set[str]
    ) -> None:
        vocab = self.model.config.vocab_size
        seen: set[str] = set()
        for row in rows:
            state = sequences.get(row.seq_id)
            if state is None:
                raise PlanError(f"row for unknown sequence {row.seq_id!r}")
            if row.seq_id in seen:
                raise PlanError(f"sequence {row.seq_id!r} has two rows in one step")
            seen.add(row.seq_id)
            if row.feed_last:
                if row.token_ids:
                    raise PlanError(f"run-ahead row for {row.seq_id!r} carries tokens")
                if row.seq_id not in self.last_token or row.seq_id in new:
                    raise PlanError(f"run-ahead row for {row.seq_id!r}: no token sampled")
            elif not row.token_ids:
                raise PlanError(f"row for {row.seq_id!r} has no tokens")
            elif min(row.token_ids) < 0 or max(row.token_ids) >= vocab:
                raise PlanError(f"row for {row.seq_id!r} has a token id outside 0..{vocab - 1}")
            if row.num_draft_tokens and (
                not row.sample or row.feed_last or row.num_draft_tokens >= len(row.token_ids)
            ):
                raise PlanError(f"row for {row.seq_id!r}: drafts must follow a sampled token")
            end = row.start_pos + row_length(row)
            if row.start_pos < 0 or end > self.max_model_len:
                raise PlanError(
                    f"row for {row.seq_id!r} spans positions {row.start_pos}..{end - 1},"
                    f" outside 0..{self.max_model_len - 1}"
                )
            if len(state.block_ids) < blocks_needed(end, self.block_size):
                raise PlanError(
                    f"sequence {row.seq_id!r} needs {blocks_needed(end, self.block_size)}"
                    f" blocks for {end} tokens, has {len(state.block_ids)}"
                )

    # --- the forward -----------------------------------------------------------------------

    def _run(self, rows: Sequence[StepRow]) -> tuple[list[RowResult], StepPhases]:
        prepare_start = self.timer()
        if any(row.num_draft_tokens for row in rows):
            rows = self._usable_rows(rows)
        batch = self.host_batch(rows)
        sampled_rows = [row for row in rows if row.sample]
        group = self.model.experts
        if group is not None:
            group.start_step(self.model.config.moe.num_experts if self.model.config.moe else 0)
        if self.follower:
            return self._run_follower(rows, batch, sampled_rows)
        # Grammar masks start filling here, on a helper thread, while the forward runs.
        prepared = self.sampling.prepare(
            [
                (r.seq_id, self.sequences[r.seq_id].sampling, r.output_index, row_drafts(r))
                for r in sampled_rows
            ]
        )
        start_ns, start = self.wall_clock_ns(), self.timer()
        with torch.inference_mode():
            logits, hidden = self._forward(batch)  # [P, V]: a position per sample or draft
            sample_start = self.timer()
            token_ids, logprobs = (
                self.sampling.sample(logits, prepared) if sampled_rows else ([], [])
            )
        accept_start = self.timer()
        emitted = verify_drafts(prepared.drafts, token_ids, logprobs)
        if self.draft_states is not None and any(prepared.drafts):
            self._settle_states(rows, [len(tokens) - 1 for tokens, _ in emitted])
        accept_s = self.timer() - accept_start
        if group is not None:  # the other ranks feed these to their run-ahead rows
            group.share([tokens for tokens, _ in emitted])
        drafts: list[list[int]] = [[] for _ in sampled_rows]
        if self.mtp is not None and hidden is not None:
            drafts = self._mtp_drafts(rows, hidden, [tokens for tokens, _ in emitted])
        if self.draft is not None:
            with torch.inference_mode():
                drafts = self.draft.propose(
                    rows,
                    [[self.last_token[r.seq_id]] if r.feed_last else r.token_ids for r in rows],
                    [tokens for tokens, _ in emitted],
                    self._packed_batch,
                    self._held_positions,
                )
        end = self.timer()
        phases = StepPhases(
            prepare_s=start - prepare_start,
            forward_s=end - start,
            sample_s=end - sample_start,
            accept_s=accept_s if any(prepared.drafts) else None,
        )
        self.last_forward_ns = (start_ns, self.wall_clock_ns())
        self.sampling.accept(prepared, [tokens for tokens, _ in emitted])
        results = [
            RowResult(
                seq_id=row.seq_id,
                token_id=tokens[0],
                logprobs=lps[0],
                extra_token_ids=tokens[1:],
                extra_logprobs=extra_logprobs(lps),
                drafts=row_drafts_,
            )
            for row, (tokens, lps), row_drafts_ in zip(sampled_rows, emitted, drafts, strict=True)
        ]
        return results, phases

    def _settle_states(self, rows: Sequence[StepRow], accepted: Sequence[int]) -> None:
        """A hybrid model: each row with drafts gets the state after its accepted ones
        (`accepted`: per sampling row)."""
        assert self.draft_states is not None and self.target_states is not None
        assert self.target_snapshots is not None
        stood = [n for n, row in zip(accepted, (r for r in rows if r.sample), strict=True)
                 if row.num_draft_tokens]  # fmt: skip
        slots = [self.sequences[row.seq_id].state_slot or 0 for row in rows]
        with torch.inference_mode():
            self.draft_states.settle(self.target_states, self.target_snapshots, rows, slots, stood)

    def _held_positions(self, seq_id: str) -> int:
        """Positions the sequence's blocks hold (within the model's length)."""
        return min(len(self.sequences[seq_id].block_ids) * self.block_size, self.max_model_len)

    def _usable_rows(self, rows: Sequence[StepRow]) -> list[StepRow]:
        """The rows with only the drafts their grammars allow, as rank 0 cut them: every
        rank of an expert-parallel group must run the same rows (collectives match by
        order and size), and only rank 0 holds the grammars."""
        group = self.model.experts
        if self.follower:
            assert group is not None
            return group.share(None)
        usable = [self._usable(row) if row.num_draft_tokens else row for row in rows]
        if group is not None:
            group.share(usable)
        return usable

    def _usable(self, row: StepRow) -> StepRow:
        """The row with only the drafts its grammar allows (fewer tokens to compute)."""
        drafts = row_drafts(row)
        params = self.sequences[row.seq_id].sampling
        n = self.sampling.usable_drafts(row.seq_id, params, row.output_index, drafts)
        if n == len(drafts):
            return row
        cut = len(row.token_ids) - len(drafts) + n
        return row.model_copy(update={"token_ids": row.token_ids[:cut], "num_draft_tokens": n})

    def _run_follower(
        self, rows: Sequence[StepRow], batch: ForwardBatch, sampled_rows: list[StepRow]
    ) -> tuple[list[RowResult], StepPhases]:
        """A follower's forward (its share of the experts' exchange, its copy of the KV
        and of the recurrent states written) and rank 0's sampled tokens, after which its
        states stand where rank 0's do."""
        group = self.model.experts
        assert group is not None
        start = self.timer()
        with torch.inference_mode():
            _logits, hidden = self._forward(batch)
        emitted = group.share(None)
        if self.draft_states is not None and any(row.num_draft_tokens for row in rows):
            self._settle_states(rows, [len(tokens) - 1 for tokens in emitted])
        if self.mtp is not None and hidden is not None:  # its MoE layer's exchange, as rank 0's
            self._mtp_drafts(rows, hidden, emitted)
        phases = StepPhases(prepare_s=0.0, forward_s=self.timer() - start, sample_s=0.0)
        results = [
            RowResult(seq_id=row.seq_id, token_id=tokens[0], extra_token_ids=tokens[1:])
            for row, tokens in zip(sampled_rows, emitted, strict=True)
        ]
        return results, phases

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's logits, and with an MTP drafter every token's hidden state too."""
        if self.mtp is None:
            return self.logits(batch), None
        batch = batch.to(self.model.device)
        if self.target_states is not None:
            assert isinstance(self.model, HybridModel)
            return self.model.forward_with_hidden(
                batch, self.kv_cache, self.target_states, self.target_snapshots
            )
        return self.model.forward_with_hidden(batch, self.kv_cache)

    def _mtp_drafts(
        self, rows: Sequence[StepRow], hidden: torch.Tensor, emitted: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """The MTP layer's drafts after each sampling row (every rank of an expert-parallel
        group runs it alike: a MoE MTP layer exchanges with the others)."""
        assert self.mtp is not None
        with torch.inference_mode():
            return self.mtp.propose(
                rows,
                [[self.last_token[r.seq_id]] if r.feed_last else r.token_ids for r in rows],
                hidden,
                emitted,
                self._packed_batch,
                self._held_positions,
            )

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs a host batch (from `host_batch`): logits [S, V] float32 of its sampling rows,
        on the device. An all-decode batch replays a CUDA graph when one holds it."""
        if self.target_states is not None:
            assert isinstance(self.model, HybridModel)
            with torch.inference_mode():
                return self.model.forward(
                    batch.to(self.model.device), self.kv_cache, self.target_states,
                    self.target_snapshots,
                )  # fmt: skip
        if self.graphs is None or not self.graphs.covers(batch):
            with torch.inference_mode():
                return self.model.forward(batch.to(self.model.device), self.kv_cache)
        logits = self.graphs.run(batch)  # [R, V], every row
        idx = batch.logits_indices
        assert idx is not None
        if idx.numel() == logits.shape[0]:  # every row samples: row r is logits row r
            return logits
        # Pageable memory is staged at once; not blocking spares waiting for the replay.
        return logits[idx.to(logits.device, non_blocking=True)]

    def capture_decode_graphs(self, sizes: Sequence[int], capture: Capture | None = None) -> None:
        """Captures a decode graph per batch size (CUDA graphs unless `capture` says
        otherwise); all-decode steps of up to max(sizes) rows replay them from then on."""
        self.graphs = None  # the old graphs' memory goes back before the new ones take theirs
        self.graphs = DecodeGraphs(self.model, self.kv_cache, sizes, self.max_model_len, capture)

    def host_batch(self, rows: Sequence[StepRow]) -> ForwardBatch:
        """The step's index tensors, built on the host (then moved in one copy per tensor).
        A row with drafts runs as one-token rows, one per position (see
        `speculative.as_decode_rows`). A decode batch is valid until the next call: the
        next decode batch of its shape is written into its tensors."""
        # A hybrid model's rows run whole: their recurrent state passes token to token.
        if self.target_states is None and any(row.num_draft_tokens for row in rows):
            rows = as_decode_rows(rows)
        if all(row.feed_last or len(row.token_ids) == 1 for row in rows):
            return self._decode_batch(rows)
        return self._packed_batch(rows)

    def _packed_batch(self, rows: Sequence[StepRow]) -> ForwardBatch:
        """`host_batch` of any rows (prefill chunks and decode rows, packed)."""
        bs = self.block_size
        token_ids: list[int] = []
        lengths, starts, block_lists = [], [], []
        for row in rows:
            row_tokens = [self.last_token[row.seq_id]] if row.feed_last else row.token_ids
            token_ids.extend(row_tokens)
            lengths.append(len(row_tokens))
            starts.append(row.start_pos)
            end = row.start_pos + len(row_tokens)
            block_lists.append(self.sequences[row.seq_id].block_ids[: blocks_needed(end, bs)])
        lens = torch.tensor(lengths, dtype=torch.int64)  # [R]
        query_start = torch.zeros(len(rows) + 1, dtype=torch.int64)
        query_start[1:] = lens.cumsum(0)  # [R + 1]
        token_rows = torch.repeat_interleave(torch.arange(len(rows)), lens)  # [T]
        offsets = torch.arange(len(token_ids)) - query_start[token_rows]  # [T]
        positions = torch.tensor(starts, dtype=torch.int64)[token_rows] + offsets  # [T]
        block_tables = block_table_tensor(block_lists, torch.device("cpu"))  # [R, MB]
        slots = slot_mapping_tensor(block_tables, token_rows, positions, bs)  # [T]
        # Logits at a sampling row's last position, and before it at each of its drafts'
        # (the position before a draft predicts it): [P] in row order.
        wanted: list[int] = []
        for row, end in zip(rows, query_start[1:].tolist(), strict=True):
            if row.sample:
                wanted.extend(range(end - 1 - row.num_draft_tokens, end))
        logits_indices = torch.tensor(wanted, dtype=torch.int64)
        context_lens = torch.tensor(starts, dtype=torch.int64) + lens  # [R]
        max_query_len = max(lengths)
        return ForwardBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=positions,
            slot_mapping=slots,
            block_tables=block_tables,
            context_lens=context_lens.to(torch.int32),
            query_start=query_start.to(torch.int32),
            logits_indices=logits_indices,
            max_query_len=max_query_len,
            max_context_len=int(context_lens.max()),
            decode_only=max_query_len == 1,
            **self._state_fields(rows),
        )

    def _state_fields(self, rows: Sequence[StepRow]) -> dict[str, Any]:
        """A hybrid model's batch fields: each row's state slot, whether it starts from a
        zero state, and the snapshots to take inside the rows (none for other models)."""
        if self.state_pool is None:
            return {}
        slots_of = [self.sequences[row.seq_id].state_slot for row in rows]
        takes = [
            (r, snap.num_tokens - 1, snap.snapshot)
            for r, row in enumerate(rows)
            for snap in row.state_snapshots
        ]
        if self.draft_states is not None:
            takes += self.draft_states.takes(rows)
        return {
            "state_slots": torch.tensor(slots_of, dtype=torch.int64),
            "state_fresh": torch.tensor([row.start_pos == 0 for row in rows], dtype=torch.bool),
            "state_takes": tuple(takes),
        }

    def _decode_batch(self, rows: Sequence[StepRow]) -> ForwardBatch:
        """`host_batch` of rows of one token each, in plain Python: a batch-1 step's host
        work is on its critical path, and the general path's tensor arithmetic (a dozen
        small torch calls) cost more than the few integers it computes. The integers are
        written into the last decode batch's tensors when it had the same shape (the next
        step of the same sequences, mostly), else into two new ones (int64, int32) whose
        slices are the fields: every new tensor costs microseconds, more once the
        forward has pushed the allocator's and torch's data out of the caches."""
        bs = self.block_size
        sequences, last_token = self.sequences, self.last_token
        tokens, positions, slots, sampled = [], [], [], []
        block_lists = []
        for i, row in enumerate(rows):
            tokens.append(last_token[row.seq_id] if row.feed_last else row.token_ids[0])
            pos = row.start_pos
            blocks = sequences[row.seq_id].block_ids[: pos // bs + 1]
            positions.append(pos)
            slots.append(blocks[-1] * bs + pos % bs)
            block_lists.append(blocks)
            if row.sample:
                sampled.append(i)
        width = max(len(b) for b in block_lists)
        wide = tokens + positions + slots + sampled
        # int32: context lengths [R], query starts [R + 1], block tables [R, MB] (padded
        # with 0: padding is never read, context_lens bound it).
        narrow = [p + 1 for p in positions]
        narrow.extend(range(len(rows) + 1))
        for blocks in block_lists:
            narrow.extend(blocks)
            if len(blocks) < width:
                narrow.extend([0] * (width - len(blocks)))
        shape = (len(rows), len(sampled), width)
        kept = self._decode_kept
        if kept is not None and kept.shape == shape:
            kept.wide[:] = wide
            kept.narrow[:] = narrow
            kept.batch.max_context_len = max(positions) + 1
            return kept.batch
        kept = _KeptDecodeBatch.build(shape, wide, narrow)
        kept.batch.max_context_len = max(positions) + 1
        if self.target_states is not None:  # a hybrid model's batch has more fields
            return dataclasses.replace(kept.batch, **self._state_fields(rows))
        self._decode_kept = kept
        return kept.batch


@dataclass
class _KeptDecodeBatch:
    """A decode batch whose fields are slices of two arrays, rewritten in place for the
    next decode step of the same shape: (rows, sampling rows, block table width)."""

    shape: tuple[int, int, int]
    batch: ForwardBatch
    wide: np.ndarray  # int64: token ids, positions, slots, logits indices
    narrow: np.ndarray  # int32: context lengths, query starts, block tables

    @staticmethod
    def build(shape: tuple[int, int, int], wide: list[int], narrow: list[int]) -> _KeptDecodeBatch:
        rows, sampled, width = shape
        wide_a, narrow_a = np.array(wide, dtype=np.int64), np.array(narrow, dtype=np.int32)
        token_ids, positions, slots, logits_indices = torch.from_numpy(wide_a).split(
            (rows, rows, rows, sampled)
        )
        context_lens, query_start, block_tables = torch.from_numpy(narrow_a).split(
            (rows, rows + 1, rows * width)
        )
        batch = ForwardBatch(
            token_ids=token_ids,
            positions=positions,
            slot_mapping=slots,
            block_tables=block_tables.view(rows, width),
            context_lens=context_lens,
            query_start=query_start,
            logits_indices=logits_indices,
            max_query_len=1,
            decode_only=True,
        )
        return _KeptDecodeBatch(shape, batch, wide_a, narrow_a)


def row_length(row: StepRow) -> int:
    return 1 if row.feed_last else len(row.token_ids)
