"""Expert parallel over two ranks (gloo, two processes) equals one process equals
transformers: greedy tokens of concurrent rows and every position's logits, with both
exchanges (all_reduce, all_to_all), on a random tiny Mixtral and on one whose router sends
every token to rank 1's experts (so rank 0's experts get no token in any step)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spillway.services.worker.expert_parallel import ExpertGroup, token_range
from spillway.shared.expert_parallel import expert_range
from tests.unit.worker import ep_ranks
from tests.unit.worker.tiny_families import (
    load_reference,
    reference_greedy,
    reference_logits,
    save_tiny_family,
)
from tests.unit.worker.tiny_llama import tiny_runner

NUM_EXPERTS = 4  # tiny Mixtral: 2 per rank, top 2
RANK_TIMEOUT_S = 120


def skew_to_rank_one(folder: Path) -> Path:
    """Every token's experts on rank 1: hidden dimension 0 carries a large constant from
    the embeddings on, and each router adds it to rank 1's experts' logits and takes it
    from rank 0's."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.embed_tokens.weight"][:, 0] = 20.0
    for name, w in tensors.items():
        if name.endswith("block_sparse_moe.gate.weight"):
            w[: NUM_EXPERTS // 2, 0] -= 5.0
            w[NUM_EXPERTS // 2 :, 0] += 5.0
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    random = save_tiny_family(tmp_path_factory.mktemp("mixtral"), "mixtral")
    skewed = skew_to_rank_one(save_tiny_family(tmp_path_factory.mktemp("skewed"), "mixtral"))
    return {"random": random, "skewed": skewed}


def run_ranks(module: str, size: int, args: list[str], timeout: float = RANK_TIMEOUT_S) -> None:
    """Runs `python -m module RANK SIZE DIST_URL *args` for every rank, each its own
    process meeting at a free local port; every rank must exit 0 within `timeout`."""
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen([sys.executable, "-m", module, str(r), str(size), url, *args])
        for r in range(size)
    ]
    try:
        codes = [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * size


@pytest.fixture(scope="module")
def two_ranks(folders, tmp_path_factory):
    """Both ranks' reports: {(model, exchange): entry} per rank."""
    out = tmp_path_factory.mktemp("ep") / "report"
    paths = [str(folders["random"]), str(folders["skewed"])]
    run_ranks("tests.unit.worker.ep_ranks", 2, [str(out), *paths])
    names = {p: name for name, p in zip(("random", "skewed"), paths, strict=True)}
    reports = []
    for rank in range(2):
        entries = json.loads(Path(f"{out}.{rank}").read_text())
        reports.append({(names[e["folder"]], e["exchange"]): e for e in entries})
    return reports


@pytest.fixture(scope="module")
def references(folders):
    """transformers' greedy tokens and logits per model, gaps and routing checked."""
    refs = {}
    for name, folder in folders.items():
        model = load_reference(folder)
        tokens = []
        for prompt in ep_ranks.PROMPTS:
            out, gap = reference_greedy(model, prompt, ep_ranks.NEW_TOKENS)
            assert gap > 1e-3, "a near tie would make the comparison meaningless"
            tokens.append(out)
        logits = torch.cat([reference_logits(model, p) for p in ep_ranks.PROMPTS])
        refs[name] = (tokens, logits, model)
    return refs


def test_skewed_router_sends_every_token_to_rank_one(references):
    tokens, _, model = references["skewed"]
    for prompt, out in zip(ep_ranks.PROMPTS, tokens, strict=True):
        with torch.inference_mode():
            got = model(torch.tensor([prompt + out]), output_router_logits=True)
        for layer_logits in got.router_logits:
            chosen = layer_logits.topk(2, dim=-1).indices
            assert bool((chosen >= NUM_EXPERTS // 2).all()), "a token chose a rank-0 expert"


@pytest.mark.parametrize("model", ["random", "skewed"])
@pytest.mark.parametrize("exchange", ["all_reduce", "all_to_all"])
def test_two_ranks_equal_one_process_and_transformers(
    two_ranks, references, folders, model, exchange
):
    want_tokens, want_logits, _ = references[model]
    one = tiny_runner(folders[model], kv_blocks=ep_ranks.KV_BLOCKS)
    from tests.unit.worker.plans import generate

    one_tokens = generate(
        one, ep_ranks.PROMPTS, ep_ranks.NEW_TOKENS, chunk=4, start_steps=[0, 1, 3]
    )
    assert one_tokens == want_tokens
    rank0, rank1 = two_ranks[0][(model, exchange)], two_ranks[1][(model, exchange)]
    assert rank0["tokens"] == want_tokens
    logits0 = torch.tensor(rank0["logits"])
    assert logits0.shape == want_logits.shape
    assert (logits0 - want_logits).abs().max().item() < 1e-4
    # Replicated: rank 1 computed the same logits.
    assert (torch.tensor(rank1["logits"]) - logits0).abs().max().item() < 1e-5
    assert rank0["bytes"] > 0


def test_skewed_rank_zero_experts_get_no_token(two_ranks):
    for exchange in ("all_reduce", "all_to_all"):
        counts = two_ranks[0][("skewed", exchange)]["expert_tokens"]
        assert counts[: NUM_EXPERTS // 2] == [0, 0]
        # Every token of the packed prompts, twice (top 2), in each of the 2 MoE layers.
        assert sum(counts) == 2 * 2 * sum(len(p) for p in ep_ranks.PROMPTS)


def test_expert_and_token_ranges():
    assert [expert_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="does not divide"):
        expert_range(6, 0, 4)
    # 5 tokens over 2 ranks: 3 and 2; 1 token over 2 ranks: rank 1 owns none.
    assert [token_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [token_range(1, r, 2) for r in range(2)] == [(0, 1), (1, 1)]


def test_a_rank_keeps_its_share_of_experts_kept_in_blocks():
    """A GGUF MoE layer's experts as the exact CPU mode keeps them (`QuantizedExperts`):
    each rank keeps its range of experts, in bytes of its own."""
    from types import SimpleNamespace

    from spillway.kernels.cpu.quantized_weight import QuantizedExperts
    from spillway.services.worker.layers.moe import MoEWeights

    def stack(rows: int, cols: int) -> QuantizedExperts:  # Q8_0: 34 bytes a block of 32
        data = torch.arange(8 * rows * cols // 32 * 34).to(torch.uint8).view(8, rows, -1)
        return QuantizedExperts((("q8_0", data),), cols)

    full = MoEWeights(router=torch.zeros(8, 64), w_gate_up=stack(64, 64), w_down=stack(64, 32))
    layer = SimpleNamespace(moe=MoEWeights(full.router, full.w_gate_up, full.w_down))
    ExpertGroup(1, 4).shard([layer])
    for got, whole in ((layer.moe.w_gate_up, full.w_gate_up), (layer.moe.w_down, full.w_down)):
        assert isinstance(got, QuantizedExperts) and got.shape[0] == 2
        assert torch.equal(got.segments[0][1], whole.segments[0][1][2:4])
        assert got.segments[0][1].untyped_storage().nbytes() == got.nbytes


def test_unknown_exchange_is_refused():
    with pytest.raises(ValueError, match="unknown expert exchange"):
        ExpertGroup(0, 2, "broadcast")  # type: ignore[arg-type]


def test_a_dense_model_or_a_bad_group_is_refused(tmp_path, folders):
    from spillway.services.worker.models.registry import load_model_config
    from spillway.shared.config import load_settings
    from spillway.shared.expert_parallel import check_expert_parallel
    from spillway.shared.model_files import resolve_model
    from tests.unit.worker.tiny_llama import write_synthetic_config

    dense_path = write_synthetic_config(tmp_path)
    dense = load_model_config(resolve_model(f"synthetic:{dense_path}"))
    moe = load_model_config(resolve_model(str(folders["random"])))
    url = "tcp://127.0.0.1:1"

    def check(config, **options):
        check_expert_parallel(load_settings(**options), config, "m")

    check(dense, expert_parallel=1)  # one process: any model
    check(moe, expert_parallel=2, rank=1, dist_url=url)
    with pytest.raises(ValueError, match="dense model"):
        check(dense, expert_parallel=2, rank=0, dist_url=url)
    with pytest.raises(ValueError, match="does not divide the model's 4 experts"):
        check(moe, expert_parallel=3, rank=0, dist_url=url)
    with pytest.raises(ValueError, match=r"--rank 2 is outside 0\.\.1"):
        check(moe, expert_parallel=2, rank=2, dist_url=url)
    with pytest.raises(ValueError, match="needs --dist-url"):
        check(moe, expert_parallel=2, rank=0)


@pytest.mark.parametrize(
    ("victim", "how"), [(1, signal.SIGKILL), (1, signal.SIGSTOP), (0, signal.SIGKILL)]
)
def test_a_rank_that_dies_or_hangs_takes_the_group_down(folders, victim, how):
    """The survivor never hangs: a dead peer's socket closes, a hung one reaches the
    group's timeout (2 s here) or the watchdog; either way it exits with code 3."""
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.unit.worker.ep_steps",
                str(r),
                url,
                str(folders["random"]),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        assert procs[0].stdout is not None
        assert procs[0].stdout.readline().strip() == "stepping"
        procs[victim].send_signal(how)
        survivor = procs[1 - victim]
        # A bound for a hang, not a measurement: the group's timeout is 2 s.
        assert survivor.wait(RANK_TIMEOUT_S) == 3
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_broken_group_says_so_once_and_issues_nothing_more():
    from spillway.services.worker.expert_parallel import GroupBroken

    said: list[str] = []
    group = ExpertGroup(0, 2, on_broken=said.append)
    group.abandon("step 7 failed")
    group.abandon("again")
    assert said == ["step 7 failed"] and group.broken
    with pytest.raises(GroupBroken):
        group.share("a plan")
