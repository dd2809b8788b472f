"""Sampling on the worker's device: greedy, temperature, top-k, top-p, min-p, logprobs.

Before the choice, a row's logits go through, in vLLM's order: logit_bias, the
repetition / frequency / presence penalties, the min_tokens ban on stop tokens and the
grammar's token mask. Logprobs are reported from the raw logits (vLLM's default).

A random row draws with the exponential race: argmax(probs / q), q ~ Exp(1) per token,
picks token i with probability probs[i]. The noise q is a counter-based hash of (sampling
seed, output index) (`services.worker.noise`), so a row samples the same token whatever else
shares the batch, in whatever order, and again after a preempted sequence is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spillway.services.worker.noise import Uniforms, exponential_noise, noise_keys, uniform_noise
from spillway.shared.protocol import SampledLogprobs, SamplingParams, TokenLogprob

MIN_TEMPERATURE = 1e-5
MaskFn = Callable[[torch.Tensor], None]  # sets disallowed logits [S, V] to -inf, in place
# [S, V] -> [S] int64, exactly torch.argmax(dim=-1) (first index of the maximum, first NaN):
# the worker passes the native CPU one (`kernels.cpu.argmax`), many times faster.
Argmax = Callable[[torch.Tensor], torch.Tensor]


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class RowSampling:
    params: SamplingParams
    output_index: int  # index of the token being sampled among the generated ones
    output_ids: Sequence[int] = ()  # generated so far (frequency / presence / repetition)
    prompt_ids: Sequence[int] = ()  # the prompt, for the repetition penalty
    banned_ids: Sequence[int] = ()  # may not be sampled now (stop tokens before min_tokens)

    @property
    def penalized(self) -> bool:
        p = self.params
        return p.frequency_penalty != 0 or p.presence_penalty != 0 or p.repetition_penalty != 1

    @property
    def processed(self) -> bool:
        """Its logits change before sampling (bias, penalties or bans)."""
        return bool(self.params.logit_bias) or self.penalized or bool(self.banned_ids)


def race_noise(
    rows: Sequence[RowSampling],
    vocab_size: int,
    device: torch.device,
    uniforms: Uniforms = uniform_noise,
) -> torch.Tensor:
    """[S, V] Exp(1) noise; row j depends only on (seed, output_index) of rows[j]. Made on
    the device in a few batched ops (no per-row generator), identical on CPU and CUDA.
    `uniforms` serves CPU devices only (the native kernel); others keep torch's."""
    keys = noise_keys([r.params.seed for r in rows], [r.output_index for r in rows], device)
    return exponential_noise(keys, vocab_size, uniforms if keys.is_cpu else uniform_noise)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[S, V] probabilities after temperature, top-k, top-p and min-p (not renormalised:
    the exponential race does not need it). logits: [S, V] float32, temperature > 0."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)  # [S, 1]
    # A vanishing temperature would overflow the scaled logits into inf - inf = NaN.
    probs = (logits / temps.clamp_min(MIN_TEMPERATURE)).softmax(dim=-1)  # [S, V]
    if any(p.top_k > 0 for p in params):
        probs = _keep_top_k(probs, [p.top_k for p in params])
        probs = probs / probs.sum(dim=-1, keepdim=True)  # top-p measures the kept mass
    if any(p.top_p < 1.0 for p in params):
        probs = _keep_top_p(probs, [p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        # min_p <= 1 keeps the most likely token whatever was asked.
        min_ps = torch.tensor([min(p.min_p, 1.0) for p in params], device=device).unsqueeze(1)
        floor = probs.amax(dim=-1, keepdim=True) * min_ps  # [S, 1]
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _keep_top_k(probs: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Zeroes all but each row's k most likely tokens (k <= 0: the row is untouched)."""
    vocab = probs.shape[-1]
    ks = [min(k, vocab) if k > 0 else 0 for k in top_ks]
    best = probs.topk(max(ks), dim=-1).values  # [S, K] descending
    kth = best.gather(1, (torch.tensor(ks, device=probs.device).clamp_min(1) - 1).unsqueeze(1))
    off = torch.tensor([k == 0 for k in ks], device=probs.device).unsqueeze(1)  # [S, 1]
    return probs.masked_fill((probs < kth) & ~off, 0.0)


# Nucleus search looks at this many of the most likely tokens first, then at the wider
# count for rows whose nucleus is wider (a flat distribution), and only then sorts the whole
# vocabulary: for 32 rows of 49152 tokens, top-256 takes 4 ms, top-4096 13 ms, a sort 75 ms.
TOP_P_CANDIDATES = 256
TOP_P_WIDE_CANDIDATES = 4096


def _keep_top_p(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keeps the smallest most-likely prefix of each row whose mass reaches top_p (the
    most likely token always stays). Looks at a few hundred candidates, then a few
    thousand, before sorting the vocabulary, only for the rows that need more."""
    device, vocab = probs.device, probs.shape[-1]
    p = torch.tensor(top_ps, device=device).unsqueeze(1)  # [S, 1]
    floor = torch.zeros_like(p)  # [S, 1]
    rows = (p < 1.0).squeeze(1).nonzero().squeeze(1)  # the rows still to settle
    counts = [c for c in (TOP_P_CANDIDATES, TOP_P_WIDE_CANDIDATES) if c < vocab] + [vocab]
    for count in counts:
        if rows.numel() == 0:
            break
        sub = probs if rows.numel() == probs.shape[0] else probs[rows]
        if count < vocab:
            best = sub.topk(count, dim=-1).values  # [W, C] descending
        else:
            best = sub.sort(dim=-1, descending=True).values  # [W, V]
        row_floor, open_ended = _nucleus_floor(best, p[rows])
        floor[rows] = row_floor
        rows = rows[open_ended]
    return probs.masked_fill((probs < floor) & (p < 1.0), 0.0)


def _nucleus_floor(
    sorted_probs: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, 1]: the smallest probability inside each row's nucleus among these candidates,
    and [W] bool: whether the nucleus may reach past them (their whole mass is <= p, so the
    next token would be inside too); the candidates of such a row are all inside."""
    cumulative = sorted_probs.cumsum(dim=-1)  # [W, C]
    mass_before = cumulative - sorted_probs
    inside = (mass_before <= p).sum(dim=-1, keepdim=True)  # >= 1: mass_before[0] == 0
    open_ended = (cumulative[:, -1:] <= p).squeeze(1)
    return sorted_probs.gather(1, inside - 1), open_ended


def process_logits(
    logits: torch.Tensor, rows: Sequence[RowSampling], mask: MaskFn | None = None
) -> torch.Tensor:
    """[S, V] logits after logit_bias, penalties, bans and the grammar `mask` (which sets
    disallowed tokens to -inf in place): a new tensor when anything applies (the raw logits
    stay for logprobs), else `logits` itself."""
    changed = [i for i, r in enumerate(rows) if r.processed]
    if not changed and mask is None:
        return logits
    out = logits.clone()
    for i in changed:
        _process_row(out[i], rows[i])
    if mask is not None:
        mask(out)
    return out


def _process_row(logits: torch.Tensor, row: RowSampling) -> None:
    """One row's logits [V], in place: bias, then penalties (vLLM's order), then bans."""
    params, device = row.params, logits.device
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=device)
        logits.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), device=device))
    if row.penalized:
        vocab = logits.shape[-1]
        output = torch.tensor(list(row.output_ids), dtype=torch.int64, device=device)
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)  # [V]
        if params.repetition_penalty != 1.0:
            prompt = torch.tensor(list(row.prompt_ids), dtype=torch.int64, device=device)
            seen = (counts > 0) | (torch.bincount(prompt, minlength=vocab)[:vocab] > 0)
            penalty = params.repetition_penalty
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits.copy_(torch.where(seen, scaled, logits))
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if row.banned_ids:
        logits[torch.tensor(list(row.banned_ids), device=device)] = float("-inf")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Sets to -inf, in place, the logits [S, V] of `rows` that the bitmask [S, ceil(V / 32)]
    int32 disallows (bit v % 32 of word v // 32 clear). Unpacking the bits with torch takes
    a fifth of the time of xgrammar's CPU kernel here, and runs on any device."""
    words = bitmask.to(logits.device, non_blocking=True)
    every_row = list(rows) == list(range(logits.shape[0]))
    if not every_row:
        words = words[torch.tensor(list(rows), device=logits.device)]  # [M, W]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[-1]]  # [M, V]
    if every_row:
        logits.masked_fill_(allowed == 0, float("-inf"))
        return
    for j, row in enumerate(rows):
        logits[row].masked_fill_(allowed[j] == 0, float("-inf"))


def sample(
    logits: torch.Tensor,
    rows: Sequence[RowSampling],
    mask: MaskFn | None = None,
    argmax: Argmax = torch_argmax,
    uniforms: Uniforms = uniform_noise,
) -> tuple[list[int], list[SampledLogprobs | None]]:
    """One token per row (and its logprobs when asked, from the raw logits). logits: [S, V]
    float32, raw; mask: the grammar's, see process_logits. Plain greedy rows (nothing to
    process, no logprobs) cost one argmax pass over the logits, read in place. `uniforms`:
    the race's uniforms on the CPU (the worker passes the native kernel's, the same values)."""
    raw, logits = logits, process_logits(logits, rows, mask)
    random_rows = [i for i, r in enumerate(rows) if r.params.temperature > 0]
    if len(random_rows) == len(rows):
        tokens = _race(logits, rows, argmax, uniforms)  # [S]
    else:
        tokens = argmax(logits)  # [S]: every greedy row in one go
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            tokens[index] = _race(logits[index], [rows[i] for i in random_rows], argmax, uniforms)
    token_ids = tokens.tolist()
    return token_ids, _logprobs(raw, rows, token_ids)


def _race(
    logits: torch.Tensor,
    rows: Sequence[RowSampling],
    argmax: Argmax = torch_argmax,
    uniforms: Uniforms = uniform_noise,
) -> torch.Tensor:
    """[S] tokens drawn from the filtered distributions by the exponential race."""
    probs = filtered_probs(logits, [r.params for r in rows])  # [S, V]
    noise = race_noise(rows, logits.shape[-1], logits.device, uniforms)  # [S, V]
    return argmax(probs.div_(noise))


def _logprobs(
    logits: torch.Tensor, rows: Sequence[RowSampling], token_ids: list[int]
) -> list[SampledLogprobs | None]:
    out: list[SampledLogprobs | None] = [None] * len(rows)
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return out
    device = logits.device
    index = torch.tensor(wanted, device=device)
    logprobs = torch.log_softmax(logits[index], dim=-1)  # [W, V]
    chosen = torch.tensor([token_ids[i] for i in wanted], device=device)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()  # [W]
    k = min(max(rows[i].params.logprobs or 0 for i in wanted), logits.shape[-1])
    top_vals_l: list[list[float]] = [[] for _ in wanted]
    top_ids_l: list[list[int]] = [[] for _ in wanted]
    if k:
        top = logprobs.topk(k, dim=-1)  # sorted, best first
        top_vals_l, top_ids_l = top.values.tolist(), top.indices.tolist()
    for w, i in enumerate(wanted):
        n = rows[i].params.logprobs or 0
        out[i] = SampledLogprobs(
            token_id=token_ids[i],
            logprob=chosen_lp[w],
            top=[
                TokenLogprob(token_id=t, logprob=v)
                for t, v in zip(top_ids_l[w][:n], top_vals_l[w][:n], strict=True)
            ],
        )
    return out
