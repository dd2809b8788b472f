"""Per-sequence sampling state on the worker: generated tokens (penalties), the region
(adaptive sampling) and the grammar matcher (structured output, forced tool calls).

The state is a function of the sequence's sampling params and its generated tokens, so it
is rebuilt, never migrated: a sequence that comes back after a preemption or a spill
arrives as a `NewSequence` carrying its tokens so far, and replaying them puts the
region and the grammar where they were (a sequence swapped in inside a think block
continues in it). A newer NewSequence always replaces the state, which also discards a
token the worker sampled in a step the scheduler then threw away (a run-ahead over-run).

A step uses it in three moments (all on the worker's step thread, but grammar work that
runs on the grammar engine's helper thread while the forward runs):

    prepare(rows)        before the forward: per-row params for the row's region, bans,
                         and the grammar masks started off the critical path
    sample(logits, ...)  after it: masks joined, tokens drawn
    accept(rows, tokens) tokens appended, regions advanced
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from spillway.services.worker.grammar import GrammarEngine
from spillway.services.worker.noise import Uniforms, uniform_noise
from spillway.services.worker.sampler import (
    Argmax,
    RowSampling,
    apply_token_bitmask,
    sample,
    torch_argmax,
)
from spillway.shared.config import Settings
from spillway.shared.model_config import ModelConfig
from spillway.shared.model_files import ModelSource
from spillway.shared.protocol import (
    NewSequence,
    RegionName,
    SampledLogprobs,
    SamplingParams,
    StepPlan,
)
from spillway.shared.regions import RegionMarkers, RegionTracker, detect_markers, marker_ids
from spillway.shared.serving import chat_template_text
from spillway.shared.tokenizer_files import load_tokenizer

log = logging.getLogger(__name__)


def _no_bytes(token_id: int) -> bytes:
    return b""


class SequenceSampling:
    """One sequence's sampling state."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        markers: RegionMarkers,
        token_bytes: Callable[[int], bytes],
        compiled: Future[Any] | None,
        engine: GrammarEngine | None,
    ) -> None:
        self.params = params
        self.prompt_ids = list(prompt_ids)
        self.output: list[int] = []
        self._markers = markers
        self._token_bytes = token_bytes
        self.tracker = RegionTracker(markers, token_bytes, params.initial_region)
        self._compiled = compiled
        self._engine = engine
        # The grammar covers output[grammar_from:]; it starts after an opening think block.
        self.grammar_from: int | None = None if params.initial_region == "think" else 0
        self._matcher: Any = None
        self._fed = 0  # output tokens the matcher has consumed (from grammar_from on)
        self._grammar_done = False  # terminated, or given up on a token it refused
        self._by_region: dict[RegionName, SamplingParams] = {}

    @property
    def region(self) -> RegionName:
        return self.tracker.region

    @property
    def constrained(self) -> bool:
        """The next token is masked by the grammar."""
        return (
            self._compiled is not None and self.grammar_from is not None and not self._grammar_done
        )

    def accept(self, token_id: int) -> None:
        before = self.tracker.region
        self.output.append(token_id)
        after = self.tracker.advance(token_id)
        if self.grammar_from is None and before == "think" and after != "think":
            self.grammar_from = len(self.output)

    def replay(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.accept(token)

    def params_here(self) -> SamplingParams:
        """The params for the next token: the region's settings replace the request's."""
        override = self.params.region_sampling.get(self.tracker.region)
        if override is None:
            return self.params
        params = self._by_region.get(self.tracker.region)
        if params is None:
            update = {k: v for k, v in override.model_dump().items() if v is not None}
            params = self.params.model_copy(update=update)
            self._by_region[self.tracker.region] = params
        return params

    def banned_ids(self, eos_ids: Sequence[int]) -> list[int]:
        """Stop tokens are masked until min_tokens are out; a grammar that must end decides
        itself (it allows only stop tokens once complete)."""
        if len(self.output) >= self.params.min_tokens or self.constrained:
            return []
        return [*eos_ids, *self.params.stop_token_ids]

    def synced_matcher(self) -> Any:
        """The matcher, fed every grammar token so far; None once the grammar is done.
        Runs on the grammar engine's thread."""
        assert self._compiled is not None and self._engine is not None
        assert self.grammar_from is not None
        if self._matcher is None:
            self._matcher = self._engine.matcher(self._compiled.result())
        while not self._grammar_done and self.grammar_from + self._fed < len(self.output):
            token = self.output[self.grammar_from + self._fed]
            if not self._matcher.accept_token(token):
                log.warning("the grammar refused token %d: sampling is free from here", token)
                self._grammar_done = True
            self._fed += 1
            if self._matcher.is_terminated():
                self._grammar_done = True
        return None if self._grammar_done else self._matcher

    def params_after(self, drafts: Sequence[int]) -> list[SamplingParams]:
        """The params for the next token and for each token after `drafts[:j]`: the
        region those drafts would lead to decides (adaptive sampling)."""
        if not self.params.region_sampling:
            return [self.params] * (len(drafts) + 1)
        out = [self.params_here()]
        tracker, self.tracker = self.tracker, copy.copy(self.tracker)
        try:
            for token in drafts:
                self.tracker.advance(token)
                out.append(self.params_here())
        finally:
            self.tracker = tracker
        return out

    def usable_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading drafts may be verified: those the grammar takes (a draft it
        refuses could never be sampled), and none past the end of a think block that a
        grammar follows (the grammar's masks start there)."""
        if self._compiled is None:
            return len(drafts)
        if self.grammar_from is None:  # thinking: the grammar starts after the block
            tracker = copy.copy(self.tracker)
            for n, token in enumerate(drafts):
                if tracker.advance(token) != "think":
                    return n
            return len(drafts)
        matcher = self.synced_matcher()
        if matcher is None:
            return len(drafts)
        n = 0
        for token in drafts:
            if not matcher.accept_token(token):
                break
            n += 1
            if matcher.is_terminated():
                break
        if n:
            matcher.rollback(n)
        return n

    def restarted(self, num_tokens: int) -> SequenceSampling:
        """A fresh state holding only the first `num_tokens` generated tokens."""
        fresh = SequenceSampling(
            self.params,
            self.prompt_ids,
            self._markers,
            self._token_bytes,
            self._compiled,
            self._engine,
        )
        fresh.replay(self.output[:num_tokens])
        return fresh


@dataclass
class PreparedSampling:
    rows: list[RowSampling]  # one per sampled position: a row's first, then its drafts'
    states: list[SequenceSampling]  # one per sampling row
    mask_rows: list[int]  # positions whose token the grammar masks
    masks: Future[torch.Tensor] | None = None
    drafts: list[list[int]] = field(default_factory=list)  # per sampling row


class SamplingStates:
    """Every running sequence's SequenceSampling, kept in step with the plans."""

    def __init__(
        self,
        eos_token_ids: Sequence[int],
        markers: RegionMarkers | None = None,
        token_bytes: Callable[[int], bytes] | None = None,
        engine: GrammarEngine | None = None,
    ) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.markers = markers or RegionMarkers(code_fence=None, tool_call_start=None)
        self.token_bytes = token_bytes or _no_bytes
        self.engine = engine
        self._states: dict[str, SequenceSampling] = {}
        # The choice of greedy rows and of the race: the worker sets its kernels' one.
        self.argmax: Argmax = torch_argmax
        # The race's uniforms on the CPU: the worker sets its kernels' native ones.
        self.uniforms: Uniforms = uniform_noise

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._states

    def get(self, seq_id: str) -> SequenceSampling | None:
        return self._states.get(seq_id)

    def apply(self, plan: StepPlan) -> None:
        """Follows an accepted plan: finished sequences are dropped, new ones (re)built."""
        for seq_id in plan.finished_seq_ids:
            self._states.pop(seq_id, None)
        for new in plan.new_seqs:
            self._states[new.seq_id] = self._build(new)

    def _build(self, new: NewSequence) -> SequenceSampling:
        grammar = new.sampling.grammar
        compiled = None
        if grammar is not None:
            if self.engine is None:
                raise RuntimeError(f"{new.seq_id} needs a grammar; this worker has no tokenizer")
            compiled = self.engine.compile(grammar)
        state = SequenceSampling(
            new.sampling,
            new.prompt_token_ids or (),
            self.markers,
            self.token_bytes,
            compiled,
            self.engine,
        )
        state.replay(new.output_token_ids)
        return state

    def _state(self, seq_id: str, params: SamplingParams, output_index: int) -> SequenceSampling:
        state = self._states.get(seq_id)
        if state is None:  # not announced through apply(): a plain state from its params
            state = self._build(NewSequence(seq_id=seq_id, sampling=params, block_ids=[]))
        if len(state.output) > output_index:
            # A token sampled past what the scheduler kept: the state holds the kept ones.
            state = state.restarted(output_index)
        elif len(state.output) < output_index:
            log.warning(
                "sequence %s samples output token %d but %d are known: penalties and regions"
                " see only those",
                seq_id,
                output_index,
                len(state.output),
            )
        self._states[seq_id] = state
        return state

    def usable_drafts(
        self, seq_id: str, params: SamplingParams, output_index: int, drafts: Sequence[int]
    ) -> int:
        """How many of a row's leading drafts may be verified (see SequenceSampling's)."""
        return self._state(seq_id, params, output_index).usable_drafts(drafts)

    def prepare(
        self, rows: Sequence[tuple[str, SamplingParams, int, Sequence[int]]]
    ) -> PreparedSampling:
        """rows: (seq_id, the sequence's params, output index, drafts) of each sampling
        row. A row with k drafts samples k + 1 positions, position j as if drafts[:j]
        had been sampled: their penalties, region and grammar state, output index + j."""
        states = [self._state(seq_id, params, index) for seq_id, params, index, _ in rows]
        sampling: list[RowSampling] = []
        mask_rows: list[int] = []
        for state, (_, _, index, drafts) in zip(states, rows, strict=True):
            for j, params in enumerate(state.params_after(drafts)):
                if state.constrained:
                    mask_rows.append(len(sampling))
                output = state.output if j == 0 else [*state.output, *drafts[:j]]
                banned = state.banned_ids(self.eos_token_ids)
                if banned and len(state.output) + j >= params.min_tokens:
                    banned = []
                sampling.append(
                    RowSampling(
                        params,
                        index + j,
                        output_ids=output,
                        prompt_ids=state.prompt_ids,
                        banned_ids=banned,
                    )
                )
        all_drafts = [list(drafts) for *_, drafts in rows]
        prepared = PreparedSampling(sampling, states, mask_rows, drafts=all_drafts)
        if mask_rows and self.engine is not None:
            constrained = [state if state.constrained else None for state in states]
            prepared.masks = self.engine.submit(
                _masks, self.engine, constrained, all_drafts, len(sampling)
            )
        return prepared

    def sample(
        self, logits: torch.Tensor, prepared: PreparedSampling
    ) -> tuple[list[int], list[SampledLogprobs | None]]:
        """Joins the grammar masks and draws one token per row."""
        if prepared.masks is None:
            return sample(logits, prepared.rows, argmax=self.argmax, uniforms=self.uniforms)
        bitmask = prepared.masks.result()  # [S, W]
        rows = prepared.mask_rows
        return sample(
            logits,
            prepared.rows,
            lambda out: apply_token_bitmask(out, bitmask, rows),
            argmax=self.argmax,
            uniforms=self.uniforms,
        )

    def accept(self, prepared: PreparedSampling, emitted: Sequence[Sequence[int]]) -> None:
        """Each sampling row's emitted tokens (one, or more when drafts stood)."""
        for state, tokens in zip(prepared.states, emitted, strict=True):
            for token in tokens:
                state.accept(token)


def _masks(
    engine: GrammarEngine,
    states: list[SequenceSampling | None],
    drafts: list[list[int]],
    num_positions: int,
) -> torch.Tensor:
    """On the grammar thread: [P, W] masks, one per sampled position; an unconstrained
    row (or a grammar that just finished) allows every token. A row's draft positions
    are masked from the grammar state after the drafts before them (taken in, then
    rolled back: the matcher follows emitted tokens only)."""
    bitmask = engine.allocate(num_positions)
    at = 0
    for state, row_drafts in zip(states, drafts, strict=True):
        matcher = state.synced_matcher() if state is not None else None
        if matcher is not None:
            taken = 0
            for j in range(len(row_drafts) + 1):
                engine.fill_row(matcher, bitmask, at + j)
                if j == len(row_drafts) or not matcher.accept_token(row_drafts[j]):
                    break
                taken += 1
                if matcher.is_terminated():
                    break
            if taken:
                matcher.rollback(taken)
        at += len(row_drafts) + 1
    return bitmask


def load_sampling_states(
    settings: Settings, source: ModelSource, config: ModelConfig
) -> SamplingStates:
    """The states for a served model: its tokenizer gives the region markers (with the
    model-profile override) and the grammar engine's vocabulary. A model without tokenizer
    files (a synthetic one) samples without regions or grammars."""
    if not _has_tokenizer(source):
        log.info("%s has no tokenizer: no regions or grammars", source.model_id)
        return SamplingStates(config.eos_token_ids)
    tokenizer = load_tokenizer(source, settings.cache_dir)
    template = chat_template_text(settings.chat_template) or tokenizer.chat_template_source
    markers = detect_markers(
        tokenizer.tokenizer.token_to_id,
        template,
        settings.region_markers,
        settings.tool_call_parser,
        settings.reasoning_parser,
    )
    engine = GrammarEngine(
        tokenizer.token_bytes,
        config.vocab_size,
        config.eos_token_ids,
        special_ids=tokenizer.special_ids,
        keep_ids=marker_ids(markers),
    )
    return SamplingStates(config.eos_token_ids, markers, tokenizer.token_bytes, engine)


def _has_tokenizer(source: ModelSource) -> bool:
    if source.kind == "gguf":
        return True
    if source.kind == "hf":
        return any(
            (source.path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
        )
    return False
