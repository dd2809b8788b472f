"""Start-up tuning decisions kept across processes, like the native builds.

A decision timed at start-up (`MatvecKernels.tune`: which projections run on one thread)
depends on the CPU, the kernels' build, the thread count and the model's shapes, not on the
process: timing it at every start cost the worker seconds of CPU. The decision is stored as
JSON under `cache_dir/tuning/`, named by a hash of everything it depends on; a missing,
unreadable or foreign file is timed afresh (and rewritten).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def decision_path(cache_dir: str | Path, name: str, key: Sequence[object]) -> Path:
    digest = hashlib.sha256(json.dumps([name, *map(str, key)]).encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "tuning" / f"{name}-{digest}.json"


def load_decision(path: Path, allowed: Sequence[int]) -> int | None:
    """The stored choice, where there is one among `allowed`."""
    try:
        choice = json.loads(path.read_text())["choice"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return choice if isinstance(choice, int) and choice in allowed else None


def store_decision(path: Path, choice: int) -> None:
    """Written beside and renamed into place: a concurrent reader never sees half a file.
    A read-only cache only costs the next start its timing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".json", delete=False) as f:
            json.dump({"choice": choice}, f)
        os.replace(f.name, path)
    except OSError as e:
        log.info("tuning decision not stored in %s: %s", path.parent, e)
