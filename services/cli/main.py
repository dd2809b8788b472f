"""The `spillway` command: `up` (the whole system), `serve <service>` (one service),
`nats-config` (the users and permissions to put into an existing nats-server's config) and
`top` (a live view of the schedulers' ticks)."""

from __future__ import annotations

import argparse
import importlib
import sys

from pydantic import ValidationError

from services.cli.bench.options import add_bench_options
from services.cli.options import add_options, overrides_from
from shared.config import Settings, load_settings

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
    nats = sub.add_parser(
        "nats-config",
        help="print nats-server users and permissions (one per service) with new passwords",
    )
    nats.add_argument("--namespace", default=defaults.namespace, help="the system's namespace")
    bench = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible server (and compare with transformers)"
    )
    add_bench_options(bench)
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
        from services.cli.nats_auth import print_config

        return print_config(args.namespace)
    if args.command == "top":
        from services.cli.top import top_main

        return top_main(args.nats_url, args.namespace, args.window)
    if args.command == "bench":
        from services.cli.bench.command import bench_main

        return bench_main(args)
    try:
        settings = load_settings(**overrides_from(args))
    except ValidationError as e:
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"])
            print(f"spillway: --{field.replace('_', '-')}: {err['msg']}", file=sys.stderr)
        return 2
    if args.command == "up":
        from services.cli.up import up

        return up(settings)
    return serve_one(args.service, settings)


def serve_one(service: str, settings: Settings) -> int:
    from shared.lifecycle import run_service

    if service == "worker":
        from services.cli.worker_env import apply_openmp_environment

        apply_openmp_environment(settings)  # before the worker's imports load torch
    # Imported lazily: the gateway never loads torch, the worker never loads FastAPI.
    module = importlib.import_module(f"services.{service}.service")
    return run_service(service, lambda stop: module.serve(settings, stop), settings.log_level)


if __name__ == "__main__":
    sys.exit(main())
