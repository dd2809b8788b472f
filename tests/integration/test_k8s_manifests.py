"""The Kubernetes manifests in infra/k8s: valid objects for the Kubernetes API they target
(checked offline against the schemas kubernetes-validate bundles), and in step with the
code they deploy: commands spillway's own parser accepts, settings shared/config.py reads,
the NATS users services/cli/nats_auth.py writes, probes on paths the gateway serves. No
cluster is needed."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from opentelemetry import trace

from spillway.services.cli.main import SERVICES, build_parser
from spillway.services.cli.nats_auth import CLIENT_USER, authorization_block
from spillway.services.cli.options import overrides_from
from spillway.services.cli.servers import find_binary
from spillway.services.gateway.app import create_app
from spillway.services.gateway.metrics import GatewayMetrics
from spillway.shared.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
# The oldest Kubernetes the manifests are written for (every API they use is stable there).
KUBERNETES_VERSION = "1.30.0"
NATS_USERS = (*SERVICES, CLIENT_USER)
NATS_SECRET = "spillway-nats"

Manifest = dict[str, Any]


def load_manifests() -> list[tuple[str, Manifest]]:
    """Every object of every file kustomization.yaml lists, with its file's name."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out = []
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc:
                out.append((name, doc))
    return out


MANIFESTS = load_manifests()


def parse(args: list[str]) -> argparse.Namespace:
    """`spillway ARGS` as the command line would take them."""
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"spillway does not accept {args} (see its error above)")


def find(kind: str, name: str) -> Manifest:
    found = [m for _, m in MANIFESTS if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(workload: Manifest) -> Manifest:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env_of(c: Manifest) -> dict[str, Manifest]:
    return {e["name"]: e for e in c.get("env", [])}


def setting_env_names() -> set[str]:
    """The environment variables Settings reads: SPILLWAY_<NAME>, or a field's one
    ecosystem alias (NATS_URL, REDIS_URL, OTEL_EXPORTER_OTLP_ENDPOINT)."""
    names = set()
    for field, info in Settings.model_fields.items():
        alias = info.validation_alias
        assert alias is None or isinstance(alias, str), f"{field}: one alias at most"
        names.add(alias or f"SPILLWAY_{field.upper()}")
    return names


def nats_conf() -> str:
    return find("ConfigMap", "nats-config")["data"]["nats.conf"]


def conf_variables(conf: str) -> set[str]:
    """The `$VAR` references of a nats-server config (comments left out)."""
    code = "\n".join(line.split("#", 1)[0] for line in conf.splitlines())
    return set(re.findall(r"\$([A-Za-z_][A-Za-z0-9_]*)", code))


def test_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_every_manifest_is_a_valid_kubernetes_object():
    errors = []
    for filename, doc in MANIFESTS:
        try:
            # strict: unknown fields (a misspelt key) are errors too.
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            name = f"{doc['kind']}/{doc['metadata']['name']}"
            errors.append(f"{filename}: {name}: {where}: {e.message}")
    assert not errors, "\n".join(errors)


def test_every_object_lives_in_the_spillway_namespace():
    namespace = find("Namespace", "spillway")["metadata"]["name"]
    for filename, m in MANIFESTS:
        if m["kind"] != "Namespace":
            assert m["metadata"].get("namespace") == namespace, (filename, m["kind"])


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_runs_a_spillway_command_its_parser_accepts(service, monkeypatch):
    c = container(find("Deployment", service))
    assert c["command"] == ["spillway"]
    args = parse(c["args"])
    assert (args.command, args.service) == ("serve", service)
    for name in setting_env_names():
        monkeypatch.delenv(name, raising=False)
    load_settings(**overrides_from(args))  # the option values validate


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_reads_only_settings_spillway_has(service, monkeypatch):
    pod = find("Deployment", service)["spec"]["template"]["spec"]
    c = container(find("Deployment", service))
    assert [s["configMapRef"]["name"] for s in c["envFrom"]] == ["spillway-config"]
    config = find("ConfigMap", "spillway-config")["data"]
    env = {e["name"]: e.get("value", "from-a-secret") for e in c.get("env", [])}
    unknown = (config.keys() | env.keys()) - setting_env_names()
    assert not unknown, f"{service} sets variables no setting reads: {sorted(unknown)}"
    # Replicas share the manifest: an id given here would be every replica's.
    assert "SPILLWAY_SERVICE_ID" not in config.keys() | env.keys()
    # Service links add <SERVICE>_PORT and the like: with a Service named spillway...,
    # SPILLWAY_PORT would be a setting.
    assert pod["enableServiceLinks"] is False
    for name in setting_env_names():
        monkeypatch.delenv(name, raising=False)
    for name, value in {**config, **env}.items():
        monkeypatch.setenv(name, value)
    settings = Settings()  # every value validates
    assert settings.nats_user == service


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_connects_to_nats_as_its_own_user(service):
    env = env_of(container(find("Deployment", service)))
    assert env["SPILLWAY_NATS_USER"]["value"] == service
    ref = env["SPILLWAY_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (NATS_SECRET, service)


def test_the_secrets_hold_placeholders_marked_for_replacement():
    passwords = find("Secret", NATS_SECRET)["stringData"]
    assert set(passwords) == {*NATS_USERS, "route"}
    assert all(v.startswith("REPLACE-ME") for v in passwords.values())
    # nats-server reads them from its environment as config values: a letter first keeps
    # each a string (a route password travels in URLs as well).
    assert all(re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", v) for v in passwords.values())


def test_the_settings_point_at_the_nats_and_redis_services():
    config = find("ConfigMap", "spillway-config")["data"]
    nats = find("Service", "nats")["spec"]
    assert config["NATS_URL"] == f"nats://nats:{nats['ports'][0]['port']}"
    redis = find("Service", "redis")["spec"]
    assert config["REDIS_URL"] == f"redis://redis:{redis['ports'][0]['port']}/0"


def probe_path(probe: Manifest) -> str:
    return probe["httpGet"]["path"]


async def test_gateway_replicas_sit_behind_a_service_with_probes_on_paths_it_serves():
    gateway = find("Deployment", "gateway")
    assert gateway["spec"]["replicas"] >= 2
    c = container(gateway)
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    service = find("Service", "gateway")["spec"]
    assert service["selector"].items() <= labels.items()
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert service["ports"][0]["targetPort"] in port_names
    args = parse(c["args"])
    assert args.host == "0.0.0.0" and port_names["http"] == args.port

    assert probe_path(c["readinessProbe"]) == "/health"
    liveness = probe_path(c["livenessProbe"])
    assert liveness == probe_path(c["startupProbe"]) != "/health"

    # The gateway's app with no scheduler nor worker, and an API key set: readiness says
    # 503, liveness still 200 (so a gateway is never restarted for the workers' sake).
    api = SimpleNamespace(
        model=SimpleNamespace(model_id="m", context_length=2048, vocab_size=32000),
        engine=SimpleNamespace(
            schedulers=SimpleNamespace(live=list),
            draining=False,
            bus=SimpleNamespace(is_connected=True),
        ),
    )
    app = create_app(api, GatewayMetrics(), trace.get_tracer(__name__), api_key="key")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        assert (await client.get("/health")).status_code == 503
        assert (await client.get(liveness)).status_code == 200


def test_workers_request_a_gpu_and_every_scheduler_gets_some():
    worker = find("Deployment", "worker")
    c = container(worker)
    assert c["image"] == "spillway:cuda"  # infra/Dockerfile.cuda
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    # Replicas of the scheduler are fault domains, each driving workers of its own.
    schedulers = find("Deployment", "scheduler")["spec"]["replicas"]
    assert schedulers >= 2 and worker["spec"]["replicas"] >= schedulers
    assert worker["spec"]["strategy"]["type"] == "Recreate"  # the GPU is freed first
    for service in ("gateway", "scheduler", "spillstore"):
        assert container(find("Deployment", service))["image"] == "spillway:cpu"


def test_nats_is_a_three_server_cluster_of_core_nats():
    nats = find("StatefulSet", "nats")["spec"]
    assert nats["replicas"] == 3
    headless = find("Service", nats["serviceName"])["spec"]
    assert headless["clusterIP"] == "None"
    conf = nats_conf()
    # spillway keeps no streams: no JetStream to run, no volume to claim.
    assert not re.search(r"^\s*jetstream\s*\{", conf, re.M)
    assert "volumeClaimTemplates" not in nats
    server = container(find("StatefulSet", "nats"))
    assert re.search(r"server_name:\s*\$POD_NAME", conf)
    # A route to every server of the set, by its stable name, with the route user's password.
    routes = re.search(r"routes:\s*\[([^\]]*)\]", conf)
    assert routes
    env = env_of(server)
    urls = [env[v.strip().removeprefix("$")]["value"] for v in routes.group(1).split(",")]
    assert urls == [
        f"nats://route:$(SPILLWAY_NATS_ROUTE_PASSWORD)@nats-{i}.{nats['serviceName']}:6222"
        for i in range(nats["replicas"])
    ]


def test_nats_users_are_the_ones_nats_auth_writes():
    namespace = find("ConfigMap", "spillway-config")["data"]["SPILLWAY_NAMESPACE"]
    expected = authorization_block(
        {user: f"$SPILLWAY_NATS_{user.upper()}_PASSWORD" for user in NATS_USERS}, namespace
    )
    assert expected in nats_conf(), (
        "infra/k8s/nats.yaml: the users block differs from what services/cli/nats_auth.py "
        "writes; put this in its place (indented):\n" + expected
    )
    # Every password the config reads comes from that user's key of the Secret.
    env = env_of(container(find("StatefulSet", "nats")))
    for user in NATS_USERS:
        ref = env[f"SPILLWAY_NATS_{user.upper()}_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (NATS_SECRET, user)
    assert conf_variables(nats_conf()) <= env.keys()


def test_the_nats_config_is_one_nats_server_accepts(tmp_path):
    env = env_of(container(find("StatefulSet", "nats")))
    # What Kubernetes would put into the server's environment.
    values = {"POD_NAME": "nats-0"} | {n: "pw" for n in env if n.endswith("_PASSWORD")}
    for name, e in env.items():
        if name.startswith("NATS_ROUTE_"):
            values[name] = e["value"].replace("$(SPILLWAY_NATS_ROUTE_PASSWORD)", "pw")
    conf = tmp_path / "nats.conf"
    conf.write_text(nats_conf().replace("/data/", f"{tmp_path}/").replace("/var/run/nats/", ""))
    check = subprocess.run(
        [find_binary("nats-server"), "-c", str(conf), "-t"],
        capture_output=True,
        text=True,
        env=values,
    )
    assert check.returncode == 0, check.stderr + check.stdout


@pytest.mark.parametrize("service", ("scheduler", "worker", "spillstore"))
def test_services_without_a_port_are_probed_through_the_health_file_they_write(service):
    c = container(find("Deployment", service))
    serve = parse(c["args"])
    assert serve.health_file is not None
    for kind in ("startupProbe", "livenessProbe"):
        command = c[kind]["exec"]["command"]
        assert command[0] == "spillway", kind
        check = parse(command[1:])
        assert check.command == "healthcheck" and check.file == serve.health_file, kind
    # A probe starts a Python process: it must not be cut short while importing.
    assert c["livenessProbe"]["timeoutSeconds"] >= 5


def test_an_expert_parallel_worker_is_a_statefulset_of_ranks_meeting_at_rank_zero(monkeypatch):
    group = find("StatefulSet", "worker-ep")
    service = find("Service", "worker-ep")
    spec, c = group["spec"], container(group)
    # Rank 0 resolves through the headless service before any rank is ready.
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert spec["serviceName"] == "worker-ep" and spec["podManagementPolicy"] == "Parallel"
    selector = spec["selector"]["matchLabels"]
    assert service["spec"]["selector"] == selector == spec["template"]["metadata"]["labels"]
    args = parse(c["args"])
    assert (args.command, args.service) == ("serve", "worker")
    env = env_of(c)
    index = "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["SPILLWAY_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == index
    assert env["SPILLWAY_NATS_USER"]["value"] == "worker"
    for name in setting_env_names():
        monkeypatch.delenv(name, raising=False)
    config = find("ConfigMap", "spillway-config")["data"]
    plain = {k: v["value"] for k, v in env.items() if "value" in v}
    for name, value in {**config, **plain, "SPILLWAY_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    settings = Settings()  # every value validates
    assert settings.expert_parallel == spec["replicas"] >= 2
    assert settings.rank == 1
    port = service["spec"]["ports"][0]["port"]
    assert settings.dist_url == f"tcp://worker-ep-0.worker-ep.spillway.svc.cluster.local:{port}"
    assert [p["containerPort"] for p in c["ports"]] == [port]
