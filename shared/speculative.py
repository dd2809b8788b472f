"""Which speculative decoding a worker can serve for a model, checked at start."""

from __future__ import annotations

from spillway.shared.config import Settings
from spillway.shared.model_config import ModelConfig


def speculation_refusal(settings: Settings, config: ModelConfig) -> str | None:
    """Why `--speculative` cannot run with this model and these settings, or None. Every
    method runs beside a hybrid model too: its recurrent state is kept at each draft
    position until the samples say which drafts stand."""
    method = settings.speculative
    if method == "none":
        return None
    if method == "mtp" and not config.num_mtp_layers:
        return (
            f"--speculative mtp: model_type {config.architecture!r} has no "
            "multi-token-prediction layers (num_nextn_predict_layers, mtp_num_hidden_layers)"
        )
    if method == "draft" and not settings.draft_model:
        return "--speculative draft needs --draft-model"
    return None
