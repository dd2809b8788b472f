"""The CPU micro-benchmark runs end to end at toy sizes and its forms agree (no timing
asserted)."""

from __future__ import annotations

import pytest

from bench import cpu_kernels


def test_cpu_bench_forms_agree_at_toy_sizes(capsys) -> None:
    shape = cpu_kernels.Shape(
        layers=2, hidden=32, intermediate=48, q_heads=4, kv_heads=2, head_dim=16, vocab=100
    )
    rows = cpu_kernels.bench_linear(shape, [1, 5], rounds=1)
    rows += cpu_kernels.bench_decode_attention(shape, batch=3, context=20, rounds=1)
    forms = {(r.name, r.form) for r in rows}
    assert ("linear", "mm(W, x^T)^T") in forms
    assert ("decode_attention", "CpuOps (shared per step)") in forms
    for row in rows:
        assert row.ms > 0 and row.max_abs_diff < 1e-4, row
    assert "decode_attention" in cpu_kernels.format_rows(rows)


def test_cpu_bench_main_prints_a_table(capsys) -> None:
    args = ["--rows", "2", "--layers", "1", "--rounds", "1", "--batch", "2", "--int8-rows", "5"]
    assert cpu_kernels.main(args) == 0
    assert "oneDNN packing" in capsys.readouterr().out


def test_int8_rows_forms_are_near_float32_at_toy_sizes() -> None:
    from spillway.kernels.cpu.linear import int8_available

    shape = cpu_kernels.Shape(
        layers=1, hidden=64, intermediate=128, q_heads=4, kv_heads=2, head_dim=16, vocab=112
    )
    rows = cpu_kernels.bench_int8_rows(shape, [6], rounds=1)
    forms = {r.form for r in rows}
    assert "float32 (oneDNN)" in forms
    assert int8_available() <= ("int8 fbgemm" in forms)
    for row in rows:  # int8 activations and weights: about 1% of outputs of unit scale
        assert row.ms > 0 and row.max_abs_diff < 0.2, row


def test_a_file_s_block_tensors_are_timed_a_type_at_a_time(tmp_path) -> None:
    from spillway.kernels.cpu import matvec
    from tests.gguf_files import Q4_K_M_NARROW, write_tiny_llama

    if matvec.load() is None:
        pytest.skip("native few-row kernels not built here (no compiler or no AVX2)")
    path = write_tiny_llama(tmp_path / "tiny-Q4_K_M.gguf", Q4_K_M_NARROW)
    rows = cpu_kernels.bench_file_blocks(str(path), [1], rounds=1)
    sizes = {r.size for r in rows}
    assert {"M=1 x 12 q5_0 weights", "M=1 x 1 q4_k weights", "M=1 x 1 q6_k weights"} <= sizes
    # int8 against the exact form: about 1% of outputs of up to ~20 (the random Q6_K
    # blocks' int8 scales make large weights)
    for row in rows:
        assert row.ms > 0 and row.max_abs_diff < 0.5, row
    assert {r.form for r in rows if r.form.endswith("x int8")}  # the integer products ran
