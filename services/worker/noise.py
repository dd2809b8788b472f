"""Sampling noise made on the device in a few batched tensor ops, for all rows at once.

Row r's noise depends only on its key, a hash of (sampling seed, output index), so a row
draws the same noise whatever else is in the batch and in whatever order, and again after a
preempted sequence is recomputed. Element [r, v] is a counter-based hash:

    u[r, v] = (mix32(code[v] ^ key[r]) >> 9 + 0.5) / 2^23        in (0, 1), 2^23 levels

where code[v] = mix32(v ^ salt) is a fixed permutation of the token ids and mix32 is the
"lowbias32" integer finaliser. It runs on int32 tensors: multiplication wraps modulo 2^32 on
the CPU and on CUDA alike, and right shifts are masked so that a set sign bit never smears
in. The integers, and so the uniforms, are identical on any device (tests check mix32
against the published function in plain Python integers); no generator state is involved.
Distinct keys XOR the same distinct codes, so two rows hash disjoint inputs (but for a
vanishing few) and their noise is unrelated. On the CPU the worker makes the same uniforms
in native code (`kernels.cpu.noise`, one pass instead of a dozen [S, V] int32 ones).

The exponential race (argmax probs / e, e ~ Exp(1)) and the Gumbel trick (argmax logits -
log e) both take e = -log(u); log may differ in the last bit between CPU and CUDA math
libraries, so only the uniforms are guaranteed bit-identical across devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import torch

_MASK64 = (1 << 64) - 1
# lowbias32's multipliers as int32 (two's complement): the product wraps the same way.
_MIX_1 = 0x21F0AAAD
_MIX_2 = 0xD35A2D97 - (1 << 32)
_CODE_SALT = 0x5BD1E995
UNIFORM_BITS = 23  # float32 holds (k + 0.5) / 2^23 exactly for every k < 2^23


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_key(seed: int, output_index: int) -> int:
    """A well-mixed 32-bit key (0 <= key < 2^32) for one (request seed, output index)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (output_index & _MASK64)) >> 32


def as_int32(value: int) -> int:
    """A 32-bit pattern as the int32 value that holds it."""
    return value - (1 << 32) if value >= 1 << 31 else value


def noise_keys(
    seeds: Sequence[int], output_indices: Sequence[int], device: torch.device | str
) -> torch.Tensor:
    """[S] int32 keys (32-bit patterns), hashed on the host (plain ints) and moved in one
    copy that does not wait for the device's queued work (the forward)."""
    keys = [as_int32(noise_key(s, i)) for s, i in zip(seeds, output_indices, strict=True)]
    return torch.tensor(keys, dtype=torch.int32).to(device, non_blocking=True)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int32 tensor (32-bit patterns), in place; returns x.

    One scratch tensor serves every shift: fresh [S, V] temporaries cost more than the
    arithmetic.
    """
    scratch = torch.empty_like(x)

    def xor_shift(bits: int) -> None:  # x ^= x >>> bits (a logical shift)
        shifted = torch.bitwise_right_shift(x, bits, out=scratch)
        x.bitwise_xor_(shifted.bitwise_and_((1 << (32 - bits)) - 1))

    xor_shift(16)
    x.mul_(_MIX_1)
    xor_shift(15)
    x.mul_(_MIX_2)
    xor_shift(15)
    return x


@lru_cache(maxsize=8)
def _token_codes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] int32: a fixed permutation of 32-bit codes, one per token id."""
    ids = torch.arange(vocab_size, dtype=torch.int32, device=device)
    return mix32(ids ^ _CODE_SALT)


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] float32 uniforms in (0, 1) for keys [S] int32 (from `noise_keys`), on the keys'
    device; row r depends only on keys[r]."""
    codes = _token_codes(vocab_size, keys.device)  # [V]
    bits = mix32(codes[None, :] ^ keys[:, None])  # [S, V] int32
    # The top UNIFORM_BITS bits, as a non-negative integer.
    bits.bitwise_right_shift_(32 - UNIFORM_BITS).bitwise_and_((1 << UNIFORM_BITS) - 1)
    return bits.float().add_(0.5).mul_(2.0**-UNIFORM_BITS)


# (keys [S] int32, V) -> [S, V] float32: `uniform_noise`'s values, by torch or natively on the
# CPU (`kernels.cpu.noise`, a fraction of the time: torch runs a dozen [S, V] int32 passes).
Uniforms = Callable[[torch.Tensor, int], torch.Tensor]


def exponential_noise(
    keys: torch.Tensor, vocab_size: int, uniforms: Uniforms = uniform_noise
) -> torch.Tensor:
    """[S, V] float32 Exp(1) noise (finite and > 0) for the exponential race. The log is
    torch's whichever `uniforms` made u: the same float32 noise, so the same sampled tokens."""
    return uniforms(keys, vocab_size).log_().neg_()
