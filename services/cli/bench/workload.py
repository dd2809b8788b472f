"""The benchmark's requests: prompt token ids, output lengths and arrival times (pure).

Prompts are token ids, sent as the completions API's `prompt: [ids]`, so every server
sees exactly the input length asked for and every peer gets the very same tokens.

    random   ids drawn uniformly from the vocabulary, special tokens left out
    text     consecutive windows of a fixed English text (the model's tokenizer encodes it)
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

DATASETS = ("random", "text")

# Public-domain prose (the opening of Jerome K. Jerome's "Three Men in a Boat", 1889), so
# text prompts read like language; prompts longer than the text wrap around.
TEXT = (
    "There were four of us - George, and William Samuel Harris, and myself, and Montmorency. "
    "We were sitting in my room, smoking, and talking about how bad we were - bad from a "
    "medical point of view I mean, of course. We were all feeling seedy, and we were getting "
    "quite nervous about it. Harris said he felt such extraordinary fits of giddiness come "
    "over him at times, that he hardly knew what he was doing; and then George said that he "
    "had fits of giddiness too, and hardly knew what he was doing. With me, it was my liver "
    "that was out of order. I knew it was my liver that was out of order, because I had just "
    "been reading a patent liver-pill circular, in which were detailed the various symptoms "
    "by which a man could tell when his liver was out of order. I had them all. It is a most "
    "extraordinary thing, but I never read a patent medicine advertisement without being "
    "impelled to the conclusion that I am suffering from the particular disease therein "
    "dealt with in its most virulent form. The diagnosis seems in every case to correspond "
    "exactly with all the sensations that I have ever felt. I remember going to the British "
    "Museum one day to read up the treatment for some slight ailment of which I had a touch "
    "- hay fever, I fancy it was. I got down the book, and read all I came to read; and then, "
    "in an unthinking moment, I idly turned the leaves, and began to indolently study "
    "diseases, generally. I forget which was the first distemper I plunged into - some "
    "fearful, devastating scourge, I know - and, before I had glanced half down the list of "
    "premonitory symptoms, it was borne in upon me that I had fairly got it. "
)


@dataclass(frozen=True)
class Workload:
    num_requests: int = 64
    input_len: int = 128
    output_len: int = 128
    # Lengths are drawn uniformly from [len * (1 - ratio), len * (1 + ratio)].
    range_ratio: float = 0.0
    dataset: str = "random"
    seed: int = 0
    # Requests per second of a Poisson process; inf: every request at once.
    rate: float = math.inf
    # Most requests in flight at once; None: no cap.
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("requests, input length and output length must be at least 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("the range ratio must be in [0, 1)")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}")
        if not self.rate > 0:
            raise ValueError("the request rate must be positive (inf: all at once)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("the concurrency must be at least 1")


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float  # when it is sent, from the start of the run


def lengths(center: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    low = max(1, math.floor(center * (1 - ratio)))
    high = max(low, math.ceil(center * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def arrival_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send times of n requests: all 0 for an infinite rate, else a Poisson process's."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def make_requests(
    workload: Workload,
    vocab_size: int,
    special_ids: Sequence[int] = (),
    text_ids: Sequence[int] = (),
) -> list[BenchRequest]:
    """The workload's requests, the same for the same seed. `text_ids` (the encoded TEXT)
    is needed for the text dataset, `vocab_size` and `special_ids` for the random one."""
    rng = random.Random(workload.seed)
    n = workload.num_requests
    in_lens = lengths(workload.input_len, workload.range_ratio, n, rng)
    out_lens = lengths(workload.output_len, workload.range_ratio, n, rng)
    arrivals = arrival_times(n, workload.rate, rng)
    if workload.dataset == "text":
        if not text_ids:
            raise ValueError("the text dataset needs the encoded text")
        prompts = [_window(text_ids, rng.randrange(len(text_ids)), k) for k in in_lens]
    else:
        allowed = sorted(set(range(vocab_size)) - set(special_ids))
        if not allowed:
            raise ValueError("no ordinary token ids to draw prompts from")
        prompts = [tuple(rng.choices(allowed, k=k)) for k in in_lens]
    return [
        BenchRequest(i, prompt, out_len, arrival)
        for i, (prompt, out_len, arrival) in enumerate(
            zip(prompts, out_lens, arrivals, strict=True)
        )
    ]


def _window(ids: Sequence[int], start: int, length: int) -> tuple[int, ...]:
    return tuple(ids[(start + i) % len(ids)] for i in range(length))
