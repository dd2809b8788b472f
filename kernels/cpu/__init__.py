"""The CPU backend: `ops.CpuOps` and what it runs, native C kernels (`csrc/`, built on first
use by `native.build`) and the torch paths around them."""
