"""Who may speak on the bus: one NATS user per service with publish and subscribe
permissions limited to its own subjects, and a `client` user for everyone else, allowed
the public `llm.*` subjects and to read the schedulers' tick reports (`sched.*.tick`,
what `spillway top` shows).

`spillway up` writes this into the config of a private nats-server (random passwords,
handed to each child in its environment); `spillway nats-config` prints it for an
existing server; infra/nats.conf holds it for docker compose. Without credentials a
connection is the `client` user (nats-server's `no_auth_user`), so the NATS API works
as before while the internal subjects stay closed to it.

Each service also answers requests: `allow_responses` lets it publish to the reply
subject of a message it received (as many replies as a stream needs) and nowhere else
it was not granted. Its own requests' replies come to `_INBOX_<service>.>` (see
shared/bus.py), which no other user may read.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from spillway.shared.bus import inbox_prefix
from spillway.shared.subjects import (
    ABORT,
    GATEWAY_HEARTBEAT,
    GENERATE,
    MODELS,
    SCHED_ABORT,
    SCHED_HEARTBEAT,
    SCHED_STATS,
    SCHED_SUBMIT,
    SPILL_DROP,
    SPILL_PREFIX_LOOKUP,
    SPILL_RECORDED,
    SPILL_STATS,
    WORKER_DISCOVER,
    WORKER_HEARTBEAT,
    WORKER_REGISTER,
    Namespace,
    gateway_deltas,
    sched_register,
    sched_stats,
    sched_submit,
    sched_tick,
    worker_step,
)

SERVICES = ("gateway", "scheduler", "worker", "spillstore")
CLIENT_USER = "client"
# Streams reply many times to one reply subject, for as long as a generation runs.
ALLOW_RESPONSES = {"max": 1_000_000, "expires": "24h"}
ANY = "*"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool = True  # may answer the requests it receives


def permissions(user: str, namespace: str = "") -> Permissions:
    """The subjects `user` (a service, or `client`) may publish and subscribe to."""
    ns = Namespace(namespace).subject
    if user == CLIENT_USER:
        return Permissions(
            publish=(ns(GENERATE), ns(ABORT), ns(MODELS)),
            subscribe=("_INBOX.>", ns(sched_tick(ANY))),
            responds=False,
        )
    own_inbox = f"{inbox_prefix(user)}.>"
    if user == "gateway":
        return Permissions(
            # Clients' default inboxes: stream chunks go there (allow_responses covers
            # clients with inboxes of their own).
            publish=(
                ns(SCHED_SUBMIT),
                ns(sched_submit(ANY)),
                ns(SCHED_ABORT),
                ns(SCHED_STATS),
                ns(sched_stats(ANY)),
                ns(GATEWAY_HEARTBEAT),
            ),
            subscribe=(
                ns(GENERATE),
                ns(ABORT),
                ns(MODELS),
                ns(gateway_deltas(ANY)),
                ns(SCHED_HEARTBEAT),
                own_inbox,
            ),
        )
    if user == "scheduler":
        return Permissions(
            publish=(
                ns(gateway_deltas(ANY)),
                ns(worker_step(ANY)),
                ns(WORKER_DISCOVER),
                ns(SCHED_HEARTBEAT),
                ns(SPILL_STATS),
                ns(SPILL_DROP),
                ns(SPILL_PREFIX_LOOKUP),
                ns(sched_tick(ANY)),
            ),
            subscribe=(
                ns(SCHED_SUBMIT),
                ns(sched_submit(ANY)),
                ns(sched_register(ANY)),
                ns(SCHED_ABORT),
                ns(SCHED_STATS),
                ns(sched_stats(ANY)),
                ns(WORKER_REGISTER),
                ns(WORKER_HEARTBEAT),
                # The other replicas' leases: a draining one hands back only what one of
                # them can take.
                ns(SCHED_HEARTBEAT),
                # Gateways alive: a dead one's requests are aborted.
                ns(GATEWAY_HEARTBEAT),
                own_inbox,
            ),
        )
    if user == "worker":
        return Permissions(
            publish=(
                ns(WORKER_REGISTER),
                ns(sched_register(ANY)),
                ns(WORKER_HEARTBEAT),
                ns(SPILL_RECORDED),
            ),
            subscribe=(ns(worker_step(ANY)), ns(WORKER_DISCOVER), ns(SCHED_HEARTBEAT), own_inbox),
        )
    if user == "spillstore":
        return Permissions(
            publish=(),
            subscribe=(
                ns(SPILL_STATS),
                ns(SPILL_RECORDED),
                ns(SPILL_DROP),
                ns(SPILL_PREFIX_LOOKUP),
                ns(WORKER_HEARTBEAT),
                # Schedulers alive: a dead one's spills are never dropped by anyone else.
                ns(SCHED_HEARTBEAT),
                own_inbox,
            ),
        )
    raise ValueError(f"no NATS user {user!r}: one of {', '.join((*SERVICES, CLIENT_USER))}")


def new_passwords() -> dict[str, str]:
    # Led by a letter: nats-server reads an unquoted `$VAR` password as a config value,
    # so one like "12k34" or "8e6..." would parse as a number (or fail) instead.
    return {user: "p" + secrets.token_urlsafe(24) for user in (*SERVICES, CLIENT_USER)}


def authorization_block(passwords: dict[str, str], namespace: str = "") -> str:
    """The `authorization { ... }` and `no_auth_user` lines of a nats-server config. A
    password value starting with `$` is written bare: nats-server reads it from the
    environment variable of that name (what infra/nats.conf does)."""
    users = []
    for user in (*SERVICES, CLIENT_USER):
        p = permissions(user, namespace)
        # allow_responses alone already denies every other publish.
        perms: dict[str, object] = {"subscribe": {"allow": list(p.subscribe)}}
        if p.publish:
            perms["publish"] = {"allow": list(p.publish)}
        if p.responds:
            perms["allow_responses"] = ALLOW_RESPONSES
        password = passwords[user]
        written = password if password.startswith("$") else json.dumps(password)
        users.append(
            f"    {{user: {json.dumps(user)}, password: {written}, "
            f"permissions: {json.dumps(perms)}}}"
        )
    return (
        "authorization {\n  users = [\n" + ",\n".join(users) + "\n  ]\n}\n"
        f"no_auth_user: {json.dumps(CLIENT_USER)}\n"
    )


def server_config(
    port: int,
    passwords: dict[str, str],
    namespace: str,
    monitor_port: int | None = None,
) -> str:
    """A whole nats-server config for a private server on 127.0.0.1."""
    lines = [
        "# Written by `spillway up` for its private nats-server.",
        "host: 127.0.0.1",
        f"port: {port}",
        "max_payload: 8MB",
    ]
    if monitor_port is not None:
        lines.append(f"http: {json.dumps(f'127.0.0.1:{monitor_port}')}")
    return "\n".join(lines) + "\n" + authorization_block(passwords, namespace)


def print_config(namespace: str = "") -> int:
    """`spillway nats-config`: the block to paste into an existing server's config, and
    the environment each service then needs."""
    passwords = new_passwords()
    print("# Add to the nats-server config, then reload it (nats-server --signal reload).")
    print(authorization_block(passwords, namespace))
    print("# Give each service its own user (docker compose: its environment section):")
    for service in SERVICES:
        print(
            f"#   {service}: SPILLWAY_NATS_USER={service} "
            f"SPILLWAY_NATS_PASSWORD={passwords[service]}"
        )
    print(
        "# Clients connect without credentials (or as `client`) and may use llm.* only,"
        " and read sched.*.tick."
    )
    return 0
