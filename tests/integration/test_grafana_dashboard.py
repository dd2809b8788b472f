"""The Grafana dashboard (infra/grafana/dashboards) names only metrics the gateway's
/metrics really exports, and Grafana and Prometheus are wired to each other and to it.

The exported names come from the gateway's own registry (services/gateway/metrics.py)
rendered in the Prometheus text format and parsed back, with the suffixes each metric
type adds to its samples."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from spillway.services.gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "infra" / "grafana" / "dashboards"
PROVISIONING = ROOT / "infra" / "grafana" / "provisioning"
PROMETHEUS = ROOT / "infra" / "prometheus" / "prometheus.yml"
COMPOSE = ROOT / "docker-compose.yml"

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("_sum", "_count", "_created"),
    "info": ("_info",),
}
# Words of PromQL that look like metric names: aggregation modifiers, vector matching,
# set operators, `bool` and `offset`.
KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "atan2",
}  # fmt: skip


def exported_names() -> set[str]:
    """Every sample name the gateway's /metrics can carry."""
    names = set()
    for family in text_string_to_metric_families(GatewayMetrics().render().decode()):
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    expr = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr
    )  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[m.end() :].lstrip()
        if rest.startswith("(") or m.group() in KEYWORDS:
            continue  # a function or an operator
        names.add(m.group())
    return names


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target (rows' panels too) and query variable."""
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard.get("templating", {}).get("list", []):
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            # label_values(METRIC, LABEL): the metric is the first argument.
            m = re.fullmatch(r"label_values\(\s*(.+?)\s*,\s*\w+\s*\)", query)
            out.append((f"variable {var['name']!r}", m.group(1) if m else query))
    return out


def balanced(expr: str) -> bool:
    """Brackets of every kind close in order (outside label values)."""
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in re.sub(r'"(?:\\.|[^"\\])*"', '""', expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def unknown_metrics(dashboard: dict[str, Any], exported: set[str]) -> list[str]:
    problems = []
    for where, expr in queries(dashboard):
        if not balanced(expr):
            problems.append(f"{where}: unbalanced brackets: {expr}")
        names = metric_names(expr)
        if not names:
            problems.append(f"{where}: names no metric: {expr}")
        problems += [f"{where}: {name} is not exported" for name in sorted(names - exported)]
    return problems


def load_dashboards() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, json.loads(p.read_text())) for p in sorted(DASHBOARDS.glob("*.json"))]


def test_the_metric_name_reader_sees_through_promql():
    expr = (
        'histogram_quantile(0.99, sum by (phase, le) (rate(a_bucket{worker=~"$w",x="y"}'
        "[$__rate_interval]))) / on (phase) group_left sum without (mode) (b_total offset 5m)"
        " > bool 1e3 and c"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}
    assert balanced(expr) and balanced('x{a="(]"}')
    assert not balanced("sum(rate(x[5m])") and not balanced("sum(x[5m)]")


def test_the_exported_names_include_each_type_s_sample_names():
    exported = exported_names()
    assert {
        "spillway_time_to_first_token_seconds_bucket",
        "spillway_scheduler_phase_seconds_count",
        "spillway_preemptions_total",
        "spillway_requests_running",
    } <= exported
    assert "spillway_preemptions" in exported  # the family name counts too


def test_every_dashboard_query_names_only_exported_metrics():
    dashboards = load_dashboards()
    assert dashboards, f"no dashboard in {DASHBOARDS}"
    exported = exported_names()
    for path, dashboard in dashboards:
        assert queries(dashboard), f"{path.name}: no query"
        problems = unknown_metrics(dashboard, exported)
        assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_a_query_naming_a_metric_that_does_not_exist_is_caught():
    _, dashboard = load_dashboards()[0]
    doctored = copy.deepcopy(dashboard)
    panel = next(p for p in doctored["panels"] if p.get("targets"))
    panel["targets"][0]["expr"] = "sum(rate(spillway_tokens_per_second_total[5m]))"
    problems = unknown_metrics(doctored, exported_names())
    assert problems == [
        f"panel {panel['title']!r} A: spillway_tokens_per_second_total is not exported"
    ]


def test_the_dashboard_covers_what_an_operator_looks_at():
    _, dashboard = load_dashboards()[0]
    named = set().union(*(metric_names(expr) for _, expr in queries(dashboard)))
    for metric in (
        "spillway_requests_running",
        "spillway_requests_waiting",
        "spillway_kv_cache_usage_ratio",
        "spillway_time_to_first_token_seconds_bucket",
        "spillway_inter_token_latency_seconds_bucket",
        "spillway_generation_tokens_total",
        "spillway_preemptions_total",
        "spillway_prefix_cache_hits_total",
        "spillway_prefix_cache_queries_total",
        "spillway_scheduler_phase_seconds_bucket",
        "spillway_worker_requests",
    ):
        assert metric in named, f"the dashboard shows no {metric}"


def test_grafana_reads_the_dashboards_from_prometheus_and_prometheus_scrapes_the_gateway():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    # The dashboard provider looks where the dashboards are mounted.
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "spillway.yml").read_text())[
        "providers"
    ]
    assert grafana_mounts["./infra/grafana/dashboards"] == provider["options"]["path"]
    assert grafana_mounts["./infra/grafana/provisioning"] == "/etc/grafana/provisioning"
    # Every panel's datasource is the provisioned one, which is the Prometheus service.
    (source,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    port = services["prometheus"]["ports"][0].split(":")[-1]
    assert source["url"] == f"http://prometheus:{port}"
    for path, dashboard in load_dashboards():
        for panel in dashboard["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == source["uid"], (path.name, panel["title"])
    # Prometheus scrapes the gateway's /metrics on the port the gateway listens on.
    prometheus_mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])
    assert prometheus_mounts["./infra/prometheus/prometheus.yml"] == (
        "/etc/prometheus/prometheus.yml"
    )
    (job,) = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    command = services["gateway"]["command"]
    gateway_port = command[command.index("--port") + 1]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"gateway:{gateway_port}"]
