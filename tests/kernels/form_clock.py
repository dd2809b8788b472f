"""A fake clock for the start-up timing of many-row forms (`PackedLinear.tune_forms`)."""

from __future__ import annotations

from spillway.kernels.cpu.linear import PackedLinear
from spillway.kernels.cpu.quantized_weight import Weight


class FormClock:
    """A clock under which the products of `slow` take ten times as long: each reading
    moves it on by what the form being timed costs (of `weight`'s shape, float32 or kept
    in blocks)."""

    def __init__(self, packed: PackedLinear, weight: Weight, slow: str) -> None:
        self.packed, self.weight, self.slow, self.now = packed, weight, slow, 0.0
        self.seen: list[str] = []

    def __call__(self) -> float:
        form = self.packed.form(self.weight)
        self.seen.append(form)
        self.now += 10.0 if form == self.slow else 1.0
        return self.now
