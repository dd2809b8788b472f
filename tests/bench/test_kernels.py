"""The benchmark script runs end to end on CPU and its checks pass (no timing asserted)."""

from __future__ import annotations

import json

import torch


def test_bench_checks_every_kernel_and_writes_json(tmp_path, monkeypatch) -> None:
    from bench import kernels as kernel_bench

    def once(fn):  # one timed call is enough to exercise the path
        fn()
        return 1.0

    monkeypatch.setattr(kernel_bench, "_time_cpu", once)
    out = tmp_path / "figures" / "kernels.json"
    assert kernel_bench.main(["--out", str(out), "--device", "cpu", "--backend", "torch"]) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "torch" and report["copy_bandwidth_gbps"] is None
    names = {row["name"] for row in report["kernels"]}
    assert names == {
        "store_kv",
        "decode_attention",
        "mixed_attention",
        "prefill_attention",
        "fused_add_rms_norm",
        "rotary",
        "fused_experts",
    }
    for row in report["kernels"]:
        assert row["ok"], row
        assert 0 <= row["rel_error"] < 1e-4
        assert row["time_us"] == 1000.0


def test_bench_flags_a_wrong_result(monkeypatch) -> None:
    from bench import kernels as kernel_bench
    from spillway.kernels.cpu.ops import CpuOps

    class OffByOne(CpuOps):
        def fused_add_rms_norm(self, x, residual, weight, eps, *, out=None):
            normed, residual = super().fused_add_rms_norm(x, residual, weight, eps, out=out)
            return normed + 1, residual

    monkeypatch.setattr(kernel_bench, "_time_cpu", lambda fn: (fn(), 1.0)[1])
    case = kernel_bench.rms_norm_case(8, 64, torch.float32, torch.device("cpu"))
    result = kernel_bench.measure(case, OffByOne(), torch.device("cpu"), None)
    assert not result.ok and result.rel_error > 0.1
