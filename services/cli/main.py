"""The `spillway` command: `up` (the whole system), `serve <service>` (one service),
`nats-config` (the users and permissions to put into an existing nats-server's config),
`healthcheck` (a container's probe of the service inside it), `bench` (a load test),
`trace` (one request's trace as a timeline) and `top` (a live view of the schedulers' ticks)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from spillway.services.cli.bench.options import add_bench_options
from spillway.services.cli.options import add_options, overrides_from
from spillway.services.cli.trace.command import add_trace_options
from spillway.shared.config import Settings, load_settings
from spillway.shared.health import DEFAULT_MAX_AGE_S, check_health_file

SERVICES = ("gateway", "scheduler", "worker", "spillstore")


def build_parser() -> argparse.ArgumentParser:
    defaults = Settings()
    parser = argparse.ArgumentParser(
        prog="spillway",
        description="LLM serving as actors on NATS: gateway, scheduler, workers, spill store.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start every service as its own process and serve HTTP")
    add_options(up, defaults)
    serve = sub.add_parser("serve", help="run one service in the foreground")
    serve.add_argument("service", choices=SERVICES)
    add_options(serve, defaults)
    serve.add_argument(
        "--health-file",
        type=Path,
        default=None,
        help="rewrite this file every few seconds once ready, for `spillway healthcheck` "
        "(default: none)",
    )
    health = sub.add_parser(
        "healthcheck",
        help="exit 0 when the service writing --file beat recently (a container's probe)",
    )
    health.add_argument("--file", type=Path, required=True, help="the service's --health-file")
    health.add_argument(
        "--max-age",
        type=float,
        default=DEFAULT_MAX_AGE_S,
        help=f"seconds a beat stays fresh (default: {DEFAULT_MAX_AGE_S:g})",
    )
    nats = sub.add_parser(
        "nats-config",
        help="print nats-server users and permissions (one per service) with new passwords",
    )
    nats.add_argument("--namespace", default=defaults.namespace, help="the system's namespace")
    bench = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible server (and compare with transformers)"
    )
    add_bench_options(bench)
    trace = sub.add_parser(
        "trace", help="print one request's trace as a timeline, from a trace file or Jaeger"
    )
    add_trace_options(trace, defaults.trace_file)
    top = sub.add_parser("top", help="live view of every scheduler's ticks (from sched.*.tick)")
    top.add_argument("--nats-url", default=defaults.nats_url, help="the system's NATS server")
    top.add_argument("--namespace", default=defaults.namespace, help="the system's namespace")
    top.add_argument(
        "--window", type=float, default=5.0, help="seconds the rates and phase times cover"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "nats-config":
        from spillway.services.cli.nats_auth import print_config

        return print_config(args.namespace)
    if args.command == "top":
        from spillway.services.cli.top import top_main

        return top_main(args.nats_url, args.namespace, args.window)
    if args.command == "bench":
        from spillway.services.cli.bench.command import bench_main

        return bench_main(args)
    if args.command == "healthcheck":
        return healthcheck(args.file, args.max_age)
    if args.command == "trace":
        from spillway.services.cli.trace.command import trace_main

        return trace_main(args)
    try:
        settings = load_settings(**overrides_from(args))
    except ValidationError as e:
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"])
            print(f"spillway: --{field.replace('_', '-')}: {err['msg']}", file=sys.stderr)
        return 2
    if args.command == "up":
        from spillway.services.cli.up import up

        return up(settings)
    return serve_one(args.service, settings, args.health_file)


def healthcheck(path: Path, max_age_s: float) -> int:
    healthy, message = check_health_file(path, max_age_s, time.time())
    print(message, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


def serve_one(service: str, settings: Settings, health_file: Path | None = None) -> int:
    from spillway.shared.lifecycle import run_service

    if service == "worker":
        from spillway.services.cli.worker_env import apply_openmp_environment

        apply_openmp_environment(settings)  # before the worker's imports load torch
    # Imported lazily: the gateway never loads torch, the worker never loads FastAPI.
    module = importlib.import_module(f"spillway.services.{service}.service")
    return run_service(
        service,
        lambda stop: module.serve(settings, stop),
        settings.log_level,
        health_file,
        settings.log_format,
        settings.memory_report_s,
    )


if __name__ == "__main__":
    sys.exit(main())
