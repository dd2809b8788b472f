"""The documents say what the code does: README's options table names every option of
`spillway up` / `serve` with its environment name and default, docs/configuration.md every
other setting, docs/observability.md every metric the gateway exports (name, type, labels),
and every link, anchor, file path, benchmark, test name and `Class.member` the documents
name exists.

A failure names the document and what it says; fix the document (or the code) so that
they agree again."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spillway.services.cli.main import build_parser
from spillway.services.cli.nats_auth import CLIENT_USER, SERVICES, permissions
from spillway.services.cli.options import OFF_SWITCHES, OPTIONS
from spillway.services.gateway.metrics import GatewayMetrics, TokenTimer
from spillway.shared.config import Settings
from spillway.shared.protocol import (
    PhaseHistogram,
    SchedulerStats,
    SpillStats,
    WorkerLoad,
)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DEPLOYMENT = DOCS / "deployment.md"
CONFIGURATION = DOCS / "configuration.md"
OBSERVABILITY = DOCS / "observability.md"

# --- reading Markdown -------------------------------------------------------------------


def documents() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def section(text: str, heading: str) -> str:
    """The lines under `heading` (a whole heading line) up to the next heading of its level
    or above."""
    level = len(heading) - len(heading.lstrip("#"))
    out: list[str] = []
    inside = False
    for _, line in prose_lines(text):
        if line.startswith("#"):
            this = len(line) - len(line.lstrip("#"))
            if inside and this <= level:
                break
            if line.strip() == heading:
                inside = True
                continue
        if inside:
            out.append(line)
    assert inside, f"no {heading!r} heading"
    return "\n".join(out)


def cells(row: str) -> list[str]:
    """A table row's cells (an escaped `\\|` stays inside its cell)."""
    parts = re.split(r"(?<!\\)\|", row.strip())
    return [p.strip() for p in parts[1:-1]]


def tables(text: str) -> Iterator[list[list[str]]]:
    """Every table's body rows (header and rule left out)."""
    rows: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.lstrip().startswith("|"):
            rows.append(line)
        elif rows:
            yield [cells(r) for r in rows[2:]]
            rows = []


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text()):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


# --- options and settings ---------------------------------------------------------------


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def command_line_options() -> set[str]:
    commands = subcommands()
    flags = set()
    for command in ("up", "serve"):
        for action in commands[command]._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
    return flags - {"--help"}


def env_name(field: str) -> str:
    alias = Settings.model_fields[field].validation_alias
    return alias if isinstance(alias, str) else f"SPILLWAY_{field.upper()}"


def readme_options() -> dict[str, list[str]]:
    (rows,) = list(tables(section(README.read_text(), "## Options")))
    out = {}
    for row in rows:
        (flag,) = code_spans(row[0])
        assert flag not in out, f"README options table: {flag} twice"
        out[flag] = row
    return out


def test_the_readme_options_table_names_every_option_and_nothing_else():
    documented = set(readme_options())
    real = command_line_options()
    assert real - documented == set(), "options missing from README's table"
    assert documented - real == set(), "README's table names options the CLI does not take"


def test_each_option_row_gives_its_environment_name_and_default():
    rows = readme_options()
    defaults = Settings()
    for flag, field, _ in OPTIONS:
        _, default, env, _ = rows[flag]
        assert code_spans(env) == [env_name(field)], f"README: {flag}'s environment name"
        value = getattr(defaults, field)
        if field in OFF_SWITCHES:
            assert default == ("on" if value else "off"), f"README: {flag}'s default"
        elif value in (None, ""):
            assert not default.startswith("`") or default.startswith("`--"), flag
        else:
            assert code_spans(default) == [str(value)], f"README: {flag}'s default"


def test_the_readme_commands_table_names_every_command():
    (rows,) = list(tables(section(README.read_text(), "## Commands")))
    named = {code_spans(row[0])[0].split()[1] for row in rows}
    assert named == set(subcommands()), "README's commands table against `spillway --help`"


def test_the_bus_users_table_gives_each_user_its_permissions():
    (rows,) = list(tables(section(DEPLOYMENT.read_text(), "## Who may speak on the bus")))
    documented = {row[0]: row for row in rows}
    assert set(documented) == {*SERVICES, CLIENT_USER}
    for user, (_, publishes, subscribes) in documented.items():
        real = permissions(user)
        own_inbox = {s for s in real.subscribe if s.startswith("_INBOX_")}
        assert set(code_spans(publishes)) == set(real.publish), f"{user} publishes"
        assert ("replies" in publishes) == real.responds, f"{user} replies"
        assert set(code_spans(subscribes)) == set(real.subscribe) - own_inbox, f"{user} subscribes"


def configuration_settings() -> set[str]:
    names = set()
    for rows in tables(CONFIGURATION.read_text()):
        for row in rows:
            names.update(code_spans(row[0]))
    return names


def test_every_setting_without_an_option_is_in_the_configuration_document():
    with_flags = {field for _, field, _ in OPTIONS}
    env_only = {env_name(f) for f in Settings.model_fields if f not in with_flags}
    documented = configuration_settings()
    assert env_only - documented == set(), f"settings missing from {CONFIGURATION.name}"
    known = {env_name(f) for f in Settings.model_fields}
    assert documented - known == set(), f"{CONFIGURATION.name} names settings that do not exist"


# --- metrics ----------------------------------------------------------------------------


def a_full_registry() -> GatewayMetrics:
    """A gateway's registry with one sample in every family, so labels show."""
    metrics = GatewayMetrics()
    histogram = PhaseHistogram(bounds=[0.1], counts=[1, 0], sum=0.05)
    worker = WorkerLoad(worker_id="w1", expert_tokens=[3], ep_exchange_seconds=histogram)
    stats = SchedulerStats(
        num_workers=1,
        num_running=1,
        num_waiting=0,
        workers=[worker],
        phases={"schedule": histogram},
        spec_accepted_per_position=[1],
        spec_phases={"spec_draft": histogram},
        spill_store=SpillStats(redis_ok=True, sequences={"s1:0": 1024}),
    )
    metrics.scheduler.update({"s1": stats})
    timer = TokenTimer(arrival=0.0)
    metrics.on_tokens(timer, 1, now=0.1)
    metrics.on_tokens(timer, 1, now=0.2)
    metrics.on_finished(timer, "stop", now=0.2)
    metrics.prompt_tokens.inc(3)
    return metrics


def exported_metrics() -> dict[str, tuple[str, set[str]]]:
    """name as /metrics shows it -> (type, labels)."""
    families = list(text_string_to_metric_families(a_full_registry().render().decode()))
    names = {f.name for f in families}
    out = {}
    for f in families:
        # The client library's `_created` series of our own counters and histograms.
        if f.name.endswith("_created") and f.name.removesuffix("_created") in names:
            continue
        labels = {k for s in f.samples for k in s.labels} - {"le"}
        shown = f"{f.name}_total" if f.type == "counter" else f.name
        out[shown] = (f.type, labels)
    return out


def documented_metrics() -> dict[str, tuple[str, set[str]]]:
    (rows, *_) = list(tables(section(OBSERVABILITY.read_text(), "## Metrics")))
    out = {}
    for row in rows:
        (name,) = code_spans(row[0])
        named = re.sub(r"\([^)]*\)", "", row[2])  # a label's values, in brackets
        labels = {span for span in code_spans(named) if re.fullmatch(r"[a-z_]+", span)}
        out[name] = (row[1], labels)
    return out


def test_the_metrics_document_lists_exactly_what_the_gateway_exports():
    exported, documented = exported_metrics(), documented_metrics()
    assert set(exported) - set(documented) == set(), "exported but not in observability.md"
    assert set(documented) - set(exported) == set(), "in observability.md but not exported"
    for name, (kind, labels) in exported.items():
        assert documented[name][0] == kind, f"observability.md: {name}'s type"
        assert documented[name][1] == labels, f"observability.md: {name}'s labels"


def test_the_full_registry_shows_every_family_with_samples():
    # Otherwise a family's labels could not be compared.
    for name, (_, labels) in exported_metrics().items():
        if name.startswith("spillway_spill_store") or name.startswith("spillway_prefix_tier"):
            continue  # the spill store's series come once, unlabelled (but for `seq`)
        if name in {"spillway_prompt_tokens_total", "spillway_generation_tokens_total"}:
            continue
        if name.startswith(("spillway_time_to", "spillway_inter_token", "spillway_e2e")):
            continue
        assert labels, f"{name} has no labelled sample in the full registry"


# --- links, paths and names -------------------------------------------------------------


def links(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in prose_lines(path.read_text()):
        line = re.sub(r"`[^`]*`", "", line)  # code spans hold no links
        for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", line):
            yield number, m.group(1)


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_anchor_resolves(path: Path):
    problems = []
    for number, target in links(path):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            problems.append(f"{number}: {target}: no such file")
        elif anchor and (dest.is_dir() or anchor not in anchors(dest)):
            problems.append(f"{number}: {target}: no such heading")
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


TOP = ("services/", "shared/", "kernels/", "tests/", "bench/", "infra/", "docs/", "csrc/")
EXTENSIONS = (".py", ".c", ".h", ".sh", ".yaml", ".yml", ".toml", ".conf")
# Folders a path in a document may start below.
PATH_BASES = (
    "",
    "kernels/",
    "kernels/cpu/",
    "infra/",
    "infra/k8s/",
    "services/",
    "services/worker/",
)
# Names of files a user or a run makes, not in the repository.
NOT_IN_REPO = {"config.json", "tokenizer.json", "tokenizer_config.json", "nats.conf"}


@cache
def repository_files() -> tuple[set[str], set[str]]:
    """(paths relative to the root, their base names), build outputs left out."""
    skip = {".git", ".venv", "build", "node_modules", ".mypy_cache", ".ruff_cache"}
    rel, names = set(), set()
    for p in ROOT.rglob("*"):
        parts = p.relative_to(ROOT).parts
        if parts and (parts[0] in skip or parts[0].endswith(".egg-info")):
            continue
        rel.add(p.relative_to(ROOT).as_posix() + ("/" if p.is_dir() else ""))
        names.add(p.name)
    return rel, names


def path_exists(token: str) -> bool:
    rel, names = repository_files()
    if "/" not in token:
        return token in names
    return any(base + token in rel or base + token + "/" in rel for base in PATH_BASES)


def named_paths(text: str) -> Iterator[tuple[int, str]]:
    for number, line in prose_lines(text):
        for span in re.findall(r"`([^`]+)`", line):
            if not re.fullmatch(r"[\w./-]+", span) or "<" in span:
                continue
            if span.startswith(TOP) or (span.endswith(EXTENSIONS) and "." in span.strip(".")):
                yield number, span


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_the_documents_name_exists(path: Path):
    missing = [
        f"{n}: {span}"
        for n, span in named_paths(path.read_text())
        if span not in NOT_IN_REPO and not path_exists(span.rstrip("/"))
    ]
    assert not missing, f"{path.name} names files that do not exist:\n" + "\n".join(missing)


@cache
def source_text() -> str:
    parts = []
    for folder in ("services", "shared", "kernels", "bench", "tests"):
        parts += [p.read_text() for p in (ROOT / folder).rglob("*.py")]
    return "\n".join(parts)


def defines(cls: str, member: str) -> bool:
    for p in [*ROOT.glob("services/**/*.py"), *ROOT.glob("shared/**/*.py"),
              *ROOT.glob("kernels/**/*.py")]:  # fmt: skip
        text = p.read_text()
        if re.search(rf"^class {cls}\b", text, re.M) and re.search(
            rf"(def {member}\b|^\s+{member}\s*[:=]|self\.{member}\s*[:=])", text, re.M
        ):
            return True
    return False


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_benchmark_test_and_class_member_the_documents_name_exists(path: Path):
    problems = []
    for number, line in prose_lines(path.read_text()):
        for module in re.findall(r"\bbench\.([a-z_0-9]+)", line):
            if module != "py" and not (ROOT / "bench" / f"{module}.py").is_file():
                problems.append(f"{number}: bench.{module}")
        for span in re.findall(r"`([^`]+)`", line):
            if re.fullmatch(r"test_\w+", span) and f"def {span}(" not in source_text():
                problems.append(f"{number}: {span}")
            m = re.fullmatch(r"([A-Z][A-Za-z0-9]+)\.([a-z_][a-z_0-9]*)(\(\))?", span)
            if m and not defines(m.group(1), m.group(2)):
                problems.append(f"{number}: {span}")
            m = re.fullmatch(r"spillway\.((?:services|shared|kernels)(?:\.\w+)*)\.(\w+)", span)
            if m:
                file = ROOT / (m.group(1).replace(".", "/") + ".py")
                if not file.is_file() or not re.search(
                    rf"^(def|class) {m.group(2)}\b|^{m.group(2)}\s*[:=]", file.read_text(), re.M
                ):
                    problems.append(f"{number}: {span}")
    assert not problems, f"{path.name} names what does not exist:\n" + "\n".join(problems)
