"""docker-compose.yml and docker-compose.gpu.yml, checked without a Docker engine: the
rules `docker compose up` relies on (every service has a healthcheck, no GPU unless the
override is given, depends_on names services that exist, mounted files and Dockerfiles
exist), and healthcheck commands that spillway's own parser accepts. Where the docker CLI
is installed, `docker compose config` parses both files as well."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway.services.cli.main import build_parser
from spillway.shared.health import HEALTH_INTERVAL_S

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "docker-compose.yml"
GPU = ROOT / "docker-compose.gpu.yml"
NO_PORT_SERVICES = ("scheduler", "worker", "spillstore")
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}

Service = dict[str, Any]


def load(path: Path) -> dict[str, Any]:
    # PyYAML resolves the anchors and `<<` merge keys as compose does.
    return yaml.safe_load(path.read_text())


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of an override file, as far as these files use it: mappings merge
    key by key (so `build.dockerfile` and `image` are replaced and `deploy` is added);
    anything else given in the override replaces the base's value."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    return copy.deepcopy(override)


def services(*paths: Path) -> dict[str, Service]:
    merged: dict[str, Any] = {}
    for path in paths:
        merged = merge(merged, load(path))
    return merged["services"]


def gpu_requests(service: Service) -> list[Any]:
    """Whatever in a service would ask Docker for a GPU."""
    found: list[Any] = []
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    for device in devices.get("devices", []):
        if device.get("driver") == "nvidia" or "gpu" in device.get("capabilities", []):
            found.append(device)
    found += [service[k] for k in ("gpus", "runtime") if k in service]
    return found


def health_test(service: Service) -> list[str]:
    test = service["healthcheck"]["test"]
    return ["CMD-SHELL", test] if isinstance(test, str) else test


def test_every_service_has_a_healthcheck():
    for name, service in services(BASE).items():
        check = service.get("healthcheck")
        assert check, f"{name} has no healthcheck"
        assert not check.get("disable"), name
        test = health_test(service)
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, (name, test)


def test_without_the_override_no_service_asks_for_a_gpu():
    base = services(BASE)
    for name, service in base.items():
        assert not gpu_requests(service), f"{name} asks for a GPU: {gpu_requests(service)}"
    worker = base["worker"]
    assert worker["image"] == "spillway:cpu"
    assert worker["build"]["dockerfile"] == "infra/Dockerfile"


def test_the_gpu_override_puts_the_worker_alone_on_a_gpu_in_the_cuda_image():
    base, merged = services(BASE), services(BASE, GPU)
    worker = merged["worker"]
    (device,) = gpu_requests(worker)
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert worker["image"] == "spillway:cuda"
    assert worker["build"] == {"context": ".", "dockerfile": "infra/Dockerfile.cuda"}
    # The rest of the worker is the base's: command, health file, credentials.
    for key in ("command", "healthcheck", "environment", "depends_on"):
        assert worker[key] == base["worker"][key], key
    assert set(load(GPU)["services"]) == {"worker"}
    for name in base.keys() - {"worker"}:
        assert merged[name] == base[name], name


def test_every_dependency_is_a_service_and_a_healthy_one_has_a_healthcheck():
    for paths in ((BASE,), (BASE, GPU)):
        all_services = services(*paths)
        for name, service in all_services.items():
            for target, spec in service.get("depends_on", {}).items():
                assert target in all_services, f"{name} depends on unknown {target}"
                assert spec["condition"] in CONDITIONS, (name, target, spec)
                if spec["condition"] == "service_healthy":
                    assert "healthcheck" in all_services[target], (name, target)


def test_the_bus_and_redis_are_healthy_before_a_spillway_service_starts():
    for name, service in services(BASE).items():
        if service.get("image", "").startswith("spillway:"):
            for dependency in ("nats", "redis"):
                condition = service["depends_on"][dependency]["condition"]
                assert condition == "service_healthy", (name, dependency)


def test_every_mounted_file_is_in_the_repository():
    mounted = 0
    for name, service in services(BASE, GPU).items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
                mounted += 1
    assert mounted >= 4  # nats.conf, prometheus.yml, Grafana's provisioning and dashboards


def test_every_spillway_image_is_built_from_a_dockerfile_in_the_repository():
    for paths in ((BASE,), (BASE, GPU)):
        built: dict[str, str] = {}
        for name, service in services(*paths).items():
            if "build" not in service:
                assert not service["image"].startswith("spillway:"), f"{name}: not built"
                continue
            dockerfile = ROOT / service["build"]["context"] / service["build"]["dockerfile"]
            assert dockerfile.is_file(), f"{name}: {dockerfile} is missing"
            assert 'ENTRYPOINT ["spillway"]' in dockerfile.read_text()
            # One tag, one Dockerfile: two services must not build different images
            # under the same name.
            assert built.setdefault(service["image"], str(dockerfile)) == str(dockerfile)


@pytest.mark.parametrize("name", NO_PORT_SERVICES)
def test_a_service_without_a_port_is_probed_through_the_health_file_it_writes(name):
    service = services(BASE)[name]
    serve = build_parser().parse_args(service["command"])
    assert (serve.command, serve.service) == ("serve", name)
    assert serve.health_file is not None
    test = health_test(service)
    assert test[:2] == ["CMD", "spillway"]
    check = build_parser().parse_args(test[2:])
    assert check.command == "healthcheck"
    assert check.file == serve.health_file
    # A few beats may be missed before the service counts as stuck.
    assert check.max_age >= 3 * HEALTH_INTERVAL_S


def test_the_gateway_is_probed_on_its_health_route_and_port():
    gateway = services(BASE)["gateway"]
    args = build_parser().parse_args(gateway["command"])
    probe = " ".join(health_test(gateway))
    assert f"http://127.0.0.1:{args.port}/health" in probe
    assert f"{args.port}:{args.port}" in gateway["ports"]


def test_nats_is_probed_on_the_monitoring_port_its_config_opens():
    nats = services(BASE)["nats"]
    conf = (ROOT / "infra" / "nats.conf").read_text()
    port = re.search(r"^http_port:\s*(\d+)", conf, re.MULTILINE)
    assert port, "infra/nats.conf opens no monitoring port"
    assert f"http://127.0.0.1:{port.group(1)}/healthz" in health_test(nats)
    # The alpine image: the plain one is a lone binary, without wget for the probe.
    assert nats["image"].endswith("-alpine")


def test_nats_runs_core_nats_without_a_store():
    # spillway speaks core NATS only (request/reply, publish/subscribe): no JetStream to
    # enable, no volume to keep for it.
    conf = (ROOT / "infra" / "nats.conf").read_text()
    assert not re.search(r"^\s*jetstream\s*\{", conf, re.MULTILINE)
    nats = services(BASE)["nats"]
    assert all(not str(v).endswith(":/data") for v in nats.get("volumes", []))
    assert "-js" not in nats["command"]


def has_docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    version = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60)
    return version.returncode == 0


@pytest.mark.skipif(not has_docker_compose(), reason="no `docker compose` on this machine")
@pytest.mark.parametrize("files", [("docker-compose.yml",), ("docker-compose.yml",
                                   "docker-compose.gpu.yml")])  # fmt: skip
def test_docker_compose_accepts_the_files(files):
    args = [a for f in files for a in ("-f", f)]
    run = subprocess.run(
        ["docker", "compose", *args, "config", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
