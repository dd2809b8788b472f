"""Which `--speculative` settings a worker refuses at start, and why."""

from __future__ import annotations

from types import SimpleNamespace

from spillway.shared.config import Settings
from spillway.shared.speculative import speculation_refusal

DENSE = SimpleNamespace(architecture="llama", hybrid=None, num_mtp_layers=0)
HYBRID = SimpleNamespace(architecture="qwen3_next", hybrid=object(), num_mtp_layers=0)


def test_ngram_is_served_and_the_other_methods_only_with_what_they_need():
    assert speculation_refusal(Settings(), DENSE) is None  # type: ignore[arg-type]
    assert speculation_refusal(Settings(speculative="ngram"), DENSE) is None  # type: ignore[arg-type]
    for method in ("draft", "mtp"):  # no --draft-model; no MTP layer
        reason = speculation_refusal(Settings(speculative=method), DENSE)  # type: ignore[arg-type]
        assert reason is not None and f"--speculative {method}" in reason
    settings = Settings(speculative="draft", draft_model="some/model")
    assert speculation_refusal(settings, DENSE) is None  # type: ignore[arg-type]


def test_every_method_is_served_beside_a_hybrid_model():
    # A hybrid model keeps its state at each draft position, whoever drafts: n-gram
    # lookups, a draft model, or its own MTP layer (where it has one).
    assert speculation_refusal(Settings(speculative="ngram"), HYBRID) is None  # type: ignore[arg-type]
    settings = Settings(speculative="draft", draft_model="some/model")
    assert speculation_refusal(settings, HYBRID) is None  # type: ignore[arg-type]
    hybrid_mtp = SimpleNamespace(architecture="qwen3_next", hybrid=object(), num_mtp_layers=1)
    assert speculation_refusal(Settings(speculative="mtp"), hybrid_mtp) is None  # type: ignore[arg-type]
    reason = speculation_refusal(Settings(speculative="mtp"), HYBRID)  # type: ignore[arg-type]
    assert reason is not None and "qwen3_next" in reason and "mtp_num_hidden_layers" in reason


def test_every_method_is_served_with_expert_parallel():
    # Expert parallel: every method; rank 0 cuts the rows, and an MTP layer runs on every
    # rank (its MoE layer exchanges as the model's do).
    with_mtp = SimpleNamespace(architecture="deepseek_v3", hybrid=None, num_mtp_layers=1)
    for settings in (
        Settings(speculative="ngram", expert_parallel=2),
        Settings(speculative="draft", draft_model="some/model", expert_parallel=2),
        Settings(speculative="mtp", expert_parallel=2),
    ):
        assert speculation_refusal(settings, with_mtp) is None  # type: ignore[arg-type]


def test_mtp_is_refused_for_a_model_without_mtp_layers():
    reason = speculation_refusal(Settings(speculative="mtp"), DENSE)  # type: ignore[arg-type]
    assert reason is not None and "no multi-token-prediction layers" in reason
