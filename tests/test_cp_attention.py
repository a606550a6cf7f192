"""Context-parallel document attention: zigzag sharding, and CP=2 on gloo vs. plain attention."""

from __future__ import annotations

import queue
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.config import load_config
from agentrl.learner.megatron import cp_attention
from agentrl.learner.megatron.cp_attention import (
    all_gather_zigzag,
    cp_document_attention,
    document_causal_attention,
    zigzag_indices,
    zigzag_local_cu_seqlens,
    zigzag_positions,
)

REPO = Path(__file__).resolve().parents[1]
CP_WORLD = 2


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor(
        [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32
    )


def _pad(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


@st.composite
def packings(draw: Any, cp_size: int, max_docs: int = 5, max_len: int = 41) -> torch.Tensor:
    """cu_seqlens of documents with odd raw lengths, each padded to a multiple of 2 * cp_size."""
    raw = draw(
        st.lists(
            st.integers(0, max_len // 2).map(lambda x: 2 * x + 1), min_size=1, max_size=max_docs
        )
    )
    return _cu([_pad(n, 2 * cp_size) for n in raw])


def _per_document_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor
) -> torch.Tensor:
    """Causal SDPA run on each document separately: an independent document-causal reference."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qd, kd, vd = (x[a:b].transpose(0, 1) for x in (q, k, v))
        kd, vd = kd.repeat_interleave(groups, 0), vd.repeat_interleave(groups, 0)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(0, 1))
    return torch.cat(outs)


def _qkv(total: int, hkv: int, groups: int, dim: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [
        (total, hkv * groups, dim),
        (total, hkv, dim),
        (total, hkv, dim),
        (total, hkv * groups, dim),
    ]
    return [torch.randn(s, generator=g) for s in shapes]  # q, k, v, grad of the output


# ---------------------------------------------------------------- zigzag sharding (one process)


def test_zigzag_small_example() -> None:
    cu = _cu([8, 4])
    assert zigzag_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert zigzag_positions(cu, 2, 1).tolist() == [2, 3, 4, 5, 1, 2]
    assert zigzag_local_cu_seqlens(cu, 2).tolist() == [0, 4, 6]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), cp_size=st.integers(1, 4))
def test_zigzag_partitions_tokens_and_balances_causal_work(
    data: st.DataObject, cp_size: int
) -> None:
    cu = data.draw(packings(cp_size))
    total = int(cu[-1])
    starts = torch.repeat_interleave(
        cu[:-1].long(), (cu[1:] - cu[:-1]).long()
    )  # [T] start of each token's doc
    shards = [zigzag_indices(cu, cp_size, r) for r in range(cp_size)]
    # Exact cover: every token on exactly one rank, equal shard sizes, increasing order on each rank.
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(total))
    assert all(s.numel() == total // cp_size for s in shards)
    assert all(bool((s[1:] > s[:-1]).all()) for s in shards)
    work = []
    for r, idx in enumerate(shards):
        pos = zigzag_positions(cu, cp_size, r)
        assert torch.equal(pos, idx - starts[idx])
        work.append(int((pos + 1).sum()))  # keys a query sees under the causal mask
    assert len(set(work)) == 1, f"causal work per rank differs: {work}"
    # Documents stay in order and each document's local part is its length / cp_size.
    local_cu = zigzag_local_cu_seqlens(cu, cp_size)
    for r, idx in enumerate(shards):
        doc = torch.searchsorted(cu[1:].long(), idx, right=True)
        counts = torch.bincount(doc, minlength=cu.numel() - 1)
        assert torch.equal(counts, (local_cu[1:] - local_cu[:-1]).long())


def test_zigzag_rejects_lengths_not_divisible_by_2cp() -> None:
    with pytest.raises(
        ValueError, match=r"document 1 has 6 tokens.*multiple of 2 \* cp = 4.*pad_multiple"
    ):
        zigzag_indices(_cu([8, 6]), 2, 0)
    with pytest.raises(ValueError, match="start at 0"):
        zigzag_indices(torch.tensor([1, 8]), 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        zigzag_indices(_cu([8]), 2, 2)
    # Without context parallelism any lengths are fine.
    assert zigzag_indices(_cu([3, 5]), 1, 0).tolist() == list(range(8))


# ---------------------------------------------------------------- attention math (one process)


@settings(max_examples=15, deadline=None)
@given(
    cu=packings(1, max_len=33),
    hkv=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_equals_per_document_causal_sdpa(
    cu: torch.Tensor, hkv: int, groups: int, seed: int
) -> None:
    q, k, v, grad = _qkv(int(cu[-1]), hkv, groups, 8, seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = document_causal_attention(*leaves, cu)
    out.backward(grad)
    expect_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expect = _per_document_reference(*expect_leaves, cu)
    expect.backward(grad)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    for got, want in zip(leaves, expect_leaves):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(data=st.data(), cp_size=st.integers(2, 4), seed=st.integers(0, 2**31 - 1))
def test_local_queries_against_gathered_keys_match_reference(
    data: st.DataObject, cp_size: int, seed: int
) -> None:
    # The mask logic for any cp_size, without processes: feed every rank the full K/V directly.
    cu = data.draw(packings(cp_size))
    q, k, v, _ = _qkv(int(cu[-1]), 2, 2, 8, seed)
    expect = document_causal_attention(q, k, v, cu)
    for r in range(cp_size):
        idx = zigzag_indices(cu, cp_size, r)
        plan = cp_attention._get_plan(cu, cp_size, r, q.device, "sdpa")
        got = cp_attention._attend(q[idx], k, v, plan, 8**-0.5, "sdpa")
        torch.testing.assert_close(got, expect[idx], atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@settings(max_examples=6, deadline=None)
@given(data=st.data(), cp_size=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_flex_mask_matches_sdpa_mask(data: st.DataObject, cp_size: int, seed: int) -> None:
    # FlexAttention's mask_mod and block mask against the explicit boolean mask (forward only:
    # FlexAttention has no CPU backward; the device bench checks its gradients on CUDA).
    cu = data.draw(packings(cp_size, max_docs=3))
    q, k, v, _ = _qkv(int(cu[-1]), 1, 3, 8, seed)
    for r in range(cp_size):
        idx = zigzag_indices(cu, cp_size, r)
        outs = [
            cp_attention._attend(
                q[idx], k, v, cp_attention._get_plan(cu, cp_size, r, q.device, b), 0.5, b
            )
            for b in ("flex", "sdpa")
        ]
        torch.testing.assert_close(*outs, atol=1e-5, rtol=1e-5)


def _dense_mask(cu: torch.Tensor, cp_size: int, rank: int) -> torch.Tensor:
    """[t_local, T] document-causal mask of this rank's zigzag queries, built the plain way."""
    lengths = (cu[1:] - cu[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    idx = zigzag_indices(cu, cp_size, rank)
    return (doc[idx][:, None] == doc[None, :]) & (idx[:, None] >= torch.arange(int(cu[-1]))[None, :])


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    cp_size=st.integers(1, 3),
    block=st.sampled_from([2, 4, 8, 16, 128]),
)
def test_flex_block_mask_equals_dense_mask(data: st.DataObject, cp_size: int, block: int) -> None:
    # The FlexAttention mask of the CP path (predicate and block classification, built without
    # a dense mask) against the boolean mask it replaces, on index grids: no kernel runs.
    from torch.nn.attention.flex_attention import create_block_mask

    cu = data.draw(packings(cp_size, max_docs=6, max_len=61))
    total = int(cu[-1])
    for r in range(cp_size):
        dense = _dense_mask(cu, cp_size, r)
        idx = zigzag_indices(cu, cp_size, r)
        start = idx - zigzag_positions(cu, cp_size, r)
        t = idx.numel()
        mask_mod = cp_attention.document_causal_mask_mod(start.int(), idx.int())
        grid = mask_mod(None, None, torch.arange(t)[:, None], torch.arange(total)[None, :])
        assert torch.equal(grid, dense)
        # Tiles: non-empty = any allowed pair, full = every pair allowed (tiles cut by the end of
        # the queries or keys never full).
        nonempty, full = cp_attention.document_causal_blocks(start, idx, total, block)
        n_q, n_k = -(-t // block), -(-total // block)
        padded = torch.zeros(n_q * block, n_k * block, dtype=torch.bool)
        padded[:t, :total] = dense
        tiles = padded.view(n_q, block, n_k, block)
        assert torch.equal(nonempty, tiles.any(3).any(1))
        assert torch.equal(full, tiles.all(3).all(1))
        # What the kernel computes: full tiles all allowed, partial tiles through mask_mod.
        bm = cp_attention.document_causal_block_mask(start, idx, total, block)
        visit = bm.to_dense()[0, 0].repeat_interleave(block, 0).repeat_interleave(block, 1)
        effective = visit[:t, :total] & grid
        assert torch.equal(effective, dense)
        # Same tiles as torch's own builder evaluating the predicate densely.
        ref = create_block_mask(mask_mod, None, None, t, total, device="cpu", BLOCK_SIZE=block,
                                _compile=False)
        for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(bm, name), getattr(ref, name)), name
        assert torch.equal(bm.to_dense(), ref.to_dense())


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=5).filter(lambda x: sum(x) > 0))
def test_cp1_core_attention_block_mask_equals_dense_mask(lengths: list[int]) -> None:
    # The CP=1 path of the Megatron core attention builds its mask with the same builder from
    # cu_seqlens (empty documents included); it must equal the document-causal mask.
    from agentrl.learner.megatron import attention

    cu = _cu(lengths)
    t = int(cu[-1])
    params = attention.make_packed_params(cu, max(lengths))
    bm = attention.document_block_mask(params, t, torch.device("cpu"))
    assert params.cache["block_mask"] is bm  # built once per micro-batch
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    dense = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    pos = torch.arange(t)
    grid = bm.mask_mod(None, None, pos[:, None], pos[None, :])
    assert torch.equal(grid, dense)
    # the mask_mod's inputs, kept for the CUDA-graph path (graphs.DecoderGraphs rebuilds the mask from them)
    q_start, q_global = params.cache["mask_rows"]
    assert torch.equal(cp_attention.document_causal_mask_mod(q_start, q_global)(None, None, pos[:, None], pos[None, :]), dense)
    n = -(-t // 128)  # 128-token tiles: non-empty = any allowed pair, full = all allowed
    padded = torch.zeros(n * 128, n * 128, dtype=torch.bool)
    padded[:t, :t] = dense
    tiles = padded.view(n, 128, n, 128)
    assert torch.equal(bm.to_dense()[0, 0], tiles.any(3).any(1))
    assert torch.equal(bm.full_kv_num_blocks[0, 0], tiles.all(3).all(1).sum(-1).int())


def test_shape_errors_are_clear() -> None:
    q, k, v, _ = _qkv(8, 2, 2, 4, 0)
    with pytest.raises(ValueError, match="must both hold 8 local tokens"):
        cp_document_attention(q[:6], k[:6], v[:6], _cu([8]), None)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        cp_document_attention(q[:, :3], k, v, _cu([8]), None)
    with pytest.raises(ValueError, match="backend"):
        cp_document_attention(q, k, v, _cu([8]), None, backend="te")  # type: ignore[arg-type]


# ---------------------------------------------------------------- CP=2 on gloo


def _run_case(rank: int, task: dict[str, Any]) -> dict[str, torch.Tensor]:
    cu = task["cu"]
    q, k, v, grad = _qkv(int(cu[-1]), task["hkv"], task["groups"], task["dim"], task["seed"])
    idx = zigzag_indices(cu, CP_WORLD, rank)
    leaves = [t[idx].clone().requires_grad_() for t in (q, k, v)]
    group = dist.group.WORLD
    out = cp_document_attention(*leaves, cu, group, softmax_scale=task["scale"])
    out.backward(grad[idx])
    return {
        "out": out.detach(),
        "dq": leaves[0].grad,
        "dk": leaves[1].grad,
        "dv": leaves[2].grad,
        "gathered_q": all_gather_zigzag(q[idx], cu, group),
    }


def _worker(rank: int, store: str, inbox: Any, outbox: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=CP_WORLD,
        timeout=timedelta(seconds=60),
    )
    while (task := inbox.get()) is not None:
        try:
            outbox.put(("ok", _run_case(rank, task)))
        except BaseException:  # noqa: BLE001 - report every failure to the test process
            outbox.put(("error", traceback.format_exc()))
    dist.destroy_process_group()


class GlooPool:
    """CP_WORLD long-lived gloo ranks, so hypothesis examples do not each pay for a spawn."""

    def __init__(self, store: Path) -> None:
        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.Queue() for _ in range(CP_WORLD)]
        self.outboxes = [ctx.Queue() for _ in range(CP_WORLD)]
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, str(store), self.inboxes[r], self.outboxes[r]), daemon=True
            )
            for r in range(CP_WORLD)
        ]
        for p in self.procs:
            p.start()
        self.failure: str | None = None

    def run(self, task: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        if self.failure is not None:
            raise AssertionError(f"gloo ranks unusable after an earlier failure:\n{self.failure}")
        for box in self.inboxes:
            box.put(task)
        results = []
        for r, box in enumerate(self.outboxes):
            try:
                status, payload = box.get(timeout=120)
            except queue.Empty:
                status, payload = "error", f"rank {r} gave no answer in 120 s"
            if status != "ok":
                self.failure = f"rank {r}: {payload}"
                raise AssertionError(self.failure)
            results.append(payload)
        return results

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


@pytest.fixture(scope="module")
def gloo_pool(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pool = GlooPool(tmp_path_factory.mktemp("gloo") / "store")
    yield pool
    pool.close()


@settings(max_examples=10, deadline=None)
@given(
    cu=packings(CP_WORLD),
    hkv=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2, 3]),
    dim=st.sampled_from([4, 8]),
    scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_cp2_on_gloo_matches_full_attention(
    gloo_pool: GlooPool,
    cu: torch.Tensor,
    hkv: int,
    groups: int,
    dim: int,
    scale: float | None,
    seed: int,
) -> None:
    task = {"cu": cu, "hkv": hkv, "groups": groups, "dim": dim, "scale": scale, "seed": seed}
    results = gloo_pool.run(task)
    q, k, v, grad = _qkv(int(cu[-1]), hkv, groups, dim, seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expect = document_causal_attention(*leaves, cu, softmax_scale=scale)
    expect.backward(grad)
    want = {
        "out": expect.detach(),
        "dq": leaves[0].grad,
        "dk": leaves[1].grad,
        "dv": leaves[2].grad,
    }
    for name, full in want.items():
        got = torch.empty_like(full)
        for r, res in enumerate(results):
            got[zigzag_indices(cu, CP_WORLD, r)] = res[name]
        torch.testing.assert_close(
            got, full, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    for res in results:
        assert torch.equal(res["gathered_q"], q)


# ---------------------------------------------------------------- the 16k long-context config


def test_long_context_16k_config_parses() -> None:
    cfg = load_config(REPO / "configs" / "long_context_16k.yaml")
    cp = cfg.learner.megatron.context_parallel_size
    assert cfg.env.id == "agentrl/FileNavigator-v0"
    assert cfg.learner.backend == "megatron" and cfg.learner.num_gpus == 2 and cp == 2
    assert cfg.rollout.max_total_tokens == 16384
    assert cfg.engine.max_model_len >= cfg.rollout.max_total_tokens
    assert cfg.packing.max_tokens_per_microbatch >= cfg.rollout.max_total_tokens
    assert cfg.packing.pad_multiple % (2 * cp) == 0
    # A 16k trajectory padded for CP still fits one micro-batch.
    assert (
        _pad(cfg.rollout.max_total_tokens, cfg.packing.pad_multiple)
        <= cfg.packing.max_tokens_per_microbatch
    )
