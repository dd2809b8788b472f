"""The NATS users and permissions: each service may use exactly the subjects it needs,
clients the public llm.* ones only; the config is one nats-server accepts, and the one in
infra/nats.conf is the one this code writes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from spillway.services.cli.nats_auth import (
    CLIENT_USER,
    SERVICES,
    authorization_block,
    new_passwords,
    permissions,
    server_config,
)
from spillway.services.cli.servers import find_binary

ROOT = Path(__file__).resolve().parents[3]


def matches(pattern: str, subject: str) -> bool:
    """NATS wildcards: `*` one token, `>` the rest."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def allowed(patterns: tuple[str, ...], subject: str) -> bool:
    return any(matches(p, subject) for p in patterns)


# What each service publishes and subscribes to (namespace "ns"), from the code's subjects.
USES = {
    "gateway": (
        ["ns.sched.submit", "ns.sched.s1.submit", "ns.sched.abort", "ns.sched.stats"],
        ["ns.llm.generate", "ns.llm.abort", "ns.llm.models", "ns.gateway.g1.deltas",
         "ns.sched.heartbeat", "_INBOX_gateway.abc.1"],
    ),
    "scheduler": (
        ["ns.gateway.g1.deltas", "ns.worker.w1.step", "ns.worker.discover", "ns.sched.heartbeat",
         "ns.sched.s1.tick"],
        ["ns.sched.submit", "ns.sched.s1.submit", "ns.sched.s1.register", "ns.sched.abort",
         "ns.sched.stats", "ns.worker.register", "ns.worker.heartbeat", "ns.sched.heartbeat",
         "_INBOX_scheduler.x.1"],
    ),
    "worker": (
        ["ns.worker.register", "ns.sched.s1.register", "ns.worker.heartbeat"],
        ["ns.worker.w1.step", "ns.worker.discover", "ns.sched.heartbeat", "_INBOX_worker.x.1"],
    ),
    "spillstore": ([], ["ns.spill.stats", "_INBOX_spillstore.x.1"]),
}  # fmt: skip
INTERNAL = [
    "ns.sched.submit", "ns.sched.abort", "ns.worker.register", "ns.worker.w1.step",
    "ns.gateway.g1.deltas", "ns.sched.heartbeat", "ns.worker.heartbeat", "ns.spill.stats",
]  # fmt: skip


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_may_use_its_own_subjects_and_no_other_namespace(service):
    p = permissions(service, "ns")
    publishes, subscribes = USES[service]
    for subject in publishes:
        assert allowed(p.publish, subject), subject
    for subject in subscribes:
        assert allowed(p.subscribe, subject), subject
    for subject in [*publishes, *subscribes]:
        if not subject.startswith("_INBOX"):
            other = "other" + subject.removeprefix("ns")
            assert not allowed(p.publish + p.subscribe, other)
    assert not allowed(p.subscribe, "_INBOX.client.1")  # nobody reads clients' replies
    assert not allowed(p.publish, "ns.llm.generate")


def test_clients_may_use_the_public_subjects_only():
    p = permissions(CLIENT_USER, "ns")
    for subject in ("ns.llm.generate", "ns.llm.abort", "ns.llm.models"):
        assert allowed(p.publish, subject)
    for subject in INTERNAL:
        assert not allowed(p.publish, subject) and not allowed(p.subscribe, subject)
    assert not p.responds


def test_clients_may_read_tick_reports_and_nothing_else_of_the_schedulers():
    p = permissions(CLIENT_USER, "ns")
    assert allowed(p.subscribe, "ns.sched.s1.tick")
    assert not allowed(p.publish, "ns.sched.s1.tick")  # read only: no forged reports
    for subject in ("other.sched.s1.tick", "ns.sched.s1.submit", "ns.sched.s1.register"):
        assert not allowed(p.subscribe, subject), subject
    # Only schedulers publish them.
    for service in SERVICES:
        may = allowed(permissions(service, "ns").publish, "ns.sched.s1.tick")
        assert may == (service == "scheduler"), service


def test_the_written_config_is_one_nats_server_accepts(tmp_path):
    conf = tmp_path / "nats.conf"
    conf.write_text(server_config(4999, new_passwords(), "ns", 8999))
    check = subprocess.run(
        [find_binary("nats-server"), "-c", str(conf), "-t"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr + check.stdout


def test_infra_nats_conf_holds_the_generated_users():
    passwords = {u: f"$SPILLWAY_NATS_{u.upper()}_PASSWORD" for u in (*SERVICES, CLIENT_USER)}
    assert authorization_block(passwords) in (ROOT / "infra" / "nats.conf").read_text()


def test_generated_passwords_are_strings_to_nats_server_even_when_read_unquoted():
    """infra/nats.conf reads each password as `$VAR`: one led by a digit could parse as a
    number; every generated one is led by a letter and unique."""
    seen = set()
    for _ in range(200):
        for password in new_passwords().values():
            assert password[0].isalpha() and len(password) >= 24
            seen.add(password)
    assert len(seen) == 200 * len(new_passwords())
