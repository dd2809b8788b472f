"""Which environment variables configure spillway: SPILLWAY_<FIELD>, plus the ecosystem's
own NATS_URL, REDIS_URL and OTEL_EXPORTER_OTLP_ENDPOINT; nothing else (a container's stray
MODEL or API_KEY must not change what is served or who may call it)."""

from __future__ import annotations

from spillway.shared.config import DEFAULT_MODEL, Settings, load_settings


def test_prefixed_and_ecosystem_names_configure_and_bare_field_names_do_not(monkeypatch):
    for name, value in {
        "MODEL": "/stray/model",
        "API_KEY": "stray",
        "OTLP_ENDPOINT": "http://stray:4318",
        "MAX_BATCH": "3",
    }.items():
        monkeypatch.setenv(name, value)
    s = Settings()
    assert s.model == DEFAULT_MODEL and s.api_key is None
    assert s.otlp_endpoint is None and s.max_batch == 64

    monkeypatch.setenv("SPILLWAY_MODEL", "/models/m")
    monkeypatch.setenv("SPILLWAY_API_KEY", "k")
    monkeypatch.setenv("SPILLWAY_MAX_BATCH", "7")
    monkeypatch.setenv("NATS_URL", "nats://bus:4222")
    monkeypatch.setenv("REDIS_URL", "redis://store:6379/0")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:4318")
    s = Settings()
    assert (s.model, s.api_key, s.max_batch) == ("/models/m", "k", 7)
    assert s.nats_url == "nats://bus:4222" and s.redis_url == "redis://store:6379/0"
    assert s.otlp_endpoint == "http://otel:4318"
    # The command line (overrides, by field name) beats the environment.
    assert load_settings(model="/cli/m", nats_url="nats://cli:1").model == "/cli/m"
    assert load_settings(nats_url="nats://cli:1").nats_url == "nats://cli:1"
