"""Grammar-constrained sampling with xgrammar: compiled grammars, per-sequence matchers,
token masks.

xgrammar was chosen by measuring mask time per token (`python -m bench.structured_output
--compare-engines`; SmolLM2's 49152 tokens, a 5-field JSON schema, 2-core CPU): xgrammar
12 us mean after a ~15 ms compile, llguidance 132 us (no compile step, spiky), outlines-core
33 us but ~2 s to index each new schema. The gateway turns response formats and forced tool
calls into xgrammar EBNF (and rejects what cannot be enforced); the worker compiles each
grammar once (cached by its text) and keeps one matcher per sequence.

Off the critical path: compiling starts when a sequence arrives and masks are filled while
the forward runs, both on one helper thread; the step waits for them only once its logits
are ready, and then applies them (sampler.apply_token_bitmask).

    bitmask: [S, ceil(V / 32)] int32, bit v % 32 of word v // 32 set = token v allowed
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")

# Compiled grammars kept for reuse (agents resend the same schemas and tools).
CACHE_LIMIT_BYTES = 256 << 20


class GrammarEngine:
    """Compiles grammars against one vocabulary and fills token masks, on a helper thread.

    token_bytes: each token id's bytes; special_ids: tokens never part of a grammar's text
    (but keep_ids among them, such as region markers a grammar writes); stop_token_ids:
    what may end the output once the grammar is complete (EOS). Importing xgrammar and
    indexing the vocabulary take a few seconds: they run first on the helper thread, so the
    worker starts meanwhile and only a grammar queued behind them waits."""

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        vocab_size: int,
        stop_token_ids: Sequence[int],
        special_ids: Collection[int] = (),
        keep_ids: Collection[int] = (),
    ) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._ready = self._pool.submit(
            self._build, token_bytes, list(stop_token_ids), special_ids, keep_ids
        )

    def _build(
        self,
        token_bytes: Callable[[int], bytes],
        stop_token_ids: list[int],
        special_ids: Collection[int],
        keep_ids: Collection[int],
    ) -> tuple[Any, Any]:
        import xgrammar as xgr  # heavy (torch, transformers): off the start-up path

        blank = set(special_ids) - set(keep_ids)
        vocab = [b"" if i in blank else token_bytes(i) for i in range(self.vocab_size)]
        info = xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids
        )
        compiler = xgr.GrammarCompiler(
            info, max_threads=1, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES
        )
        return xgr, compiler

    def wait_ready(self) -> None:
        self._ready.result()

    def compile(self, ebnf: str) -> Future[Any]:
        """Starts compiling on the helper thread; the future holds the CompiledGrammar."""
        return self._pool.submit(lambda: self._ready.result()[1].compile_grammar(ebnf))

    def matcher(self, compiled: Any) -> Any:
        return self._ready.result()[0].GrammarMatcher(compiled)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Runs `fn` on the helper thread (after the compiles queued before it)."""
        return self._pool.submit(fn, *args)

    def fill(self, matchers: Sequence[Any]) -> torch.Tensor:
        """[len(matchers), ceil(V / 32)] int32 masks, one row per batch row (a None row
        allows every token)."""
        xgr = self._ready.result()[0]
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # all set
        for row, matcher in enumerate(matchers):
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask

    def allocate(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(V / 32)] int32 masks allowing every token."""
        return self._ready.result()[0].allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_row(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
