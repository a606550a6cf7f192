"""Weight transports (agentrl/weights/transports.py): flat-buffer layout, transport choice, and the broadcast
protocol between a learner and engine workers over a process group of its own (gloo on CPU)."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.config import ConfigError, load_config
from agentrl.weights.transports import (
    FlatSpec,
    WeightGroup,
    flatten_weights,
    resolve_transport,
    unflatten_weights,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


@st.composite
def state_dicts(draw) -> dict[str, torch.Tensor]:
    n = draw(st.integers(1, 6))
    out = {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        out[f"layer.{i}.weight"] = (torch.randn(shape) * 10).to(dtype)
    return out


@settings(max_examples=60, deadline=None)
@given(state_dicts())
def test_flatten_round_trips_every_tensor_exactly(weights):
    buf, spec = flatten_weights(weights, skip_shared=False)
    assert buf.dtype == torch.uint8 and buf.numel() >= spec.nbytes
    back = dict(unflatten_weights(buf, spec))
    assert list(back) == list(weights)
    for name, t in weights.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t)
    assert all(off % 256 == 0 for off in spec.offsets)


def test_flatten_skips_tied_copies_and_keeps_views_into_the_buffer():
    emb = torch.randn(8, 4)
    weights = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(4)}
    buf, spec = flatten_weights(weights)
    assert spec.names == ("model.embed_tokens.weight", "norm.weight")
    views = dict(unflatten_weights(buf, spec))
    buf.zero_()  # views, not copies: the engine loads straight from the shared buffer
    assert torch.count_nonzero(views["model.embed_tokens.weight"]) == 0


def test_flatten_keeps_every_view_of_a_fused_weight():
    """q/k/v (and gate/up) exported as views of one fused tensor share a storage: all are kept
    (dropping all but the first was a real bug: the engine kept stale k/v weights)."""
    fused = torch.randn(12, 4)
    q, k, v = fused.split([8, 2, 2])
    buf, spec = flatten_weights({"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v})
    assert spec.names == ("q_proj.weight", "k_proj.weight", "v_proj.weight")
    back = dict(unflatten_weights(buf, spec))
    assert all(torch.equal(back[n], t) for n, t in (("q_proj.weight", q), ("k_proj.weight", k), ("v_proj.weight", v)))


def test_unflatten_rejects_a_short_or_typed_buffer():
    buf, spec = flatten_weights({"a": torch.ones(64)})
    with pytest.raises(ValueError, match="flat uint8 buffer"):
        list(unflatten_weights(buf[:10], spec))
    with pytest.raises(ValueError, match="flat uint8 buffer"):
        list(unflatten_weights(buf.float(), spec))


@pytest.mark.parametrize("requested,gpu,same,expected", [
    ("auto", False, False, "object_store"),
    ("auto", True, True, "cuda_ipc"),
    ("auto", True, False, "nccl"),
    ("object_store", True, True, "object_store"),
    ("nccl", True, True, "nccl"),
    ("nccl", False, False, "nccl"),  # gloo on CPU
])
def test_resolve_transport(requested, gpu, same, expected):
    assert resolve_transport(requested, engine_on_gpu=gpu, same_gpu=same) == expected


def test_cuda_ipc_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="refit.transport=cuda_ipc"):
        resolve_transport("cuda_ipc", engine_on_gpu=True, same_gpu=False)
    with pytest.raises(ValueError, match="unknown transport"):
        resolve_transport("carrier_pigeon", engine_on_gpu=False, same_gpu=False)


def test_config_checks_the_transport_against_the_placement():
    with pytest.raises(ConfigError, match="cuda_ipc"):
        load_config(None, ["refit.transport=cuda_ipc"])  # CPU engines: no GPU to share
    cfg = load_config(None, ["refit.transport=nccl"])
    assert cfg.refit.transport == "nccl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receiver(port: int, rank: int, world: int, spec: FlatSpec, queue) -> None:
    group = WeightGroup("127.0.0.1", port, rank, world, backend="gloo", timeout_s=60)
    buf = torch.zeros(spec.nbytes, dtype=torch.uint8)
    for _ in range(2):  # two refits over one group
        group.broadcast(buf)
        queue.put({n: t.clone() for n, t in unflatten_weights(buf, spec)})
    group.close()


def test_broadcast_protocol_over_gloo_reaches_every_worker_bit_exact():
    """Rank 0 (the learner) broadcasts one flat buffer to two receivers (engine workers) twice;
    each receiver rebuilds exactly the sender's named tensors each time."""
    torch.manual_seed(0)
    weights = {"a.weight": torch.randn(33, 7).to(torch.bfloat16), "b.bias": torch.randn(5), "c": torch.arange(9)}
    buf, spec = flatten_weights(weights)
    port, world = _free_port(), 3
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(port, r, world, spec, queue)) for r in (1, 2)]
    for p in procs:
        p.start()
    group = WeightGroup("127.0.0.1", port, 0, world, backend="gloo", timeout_s=60)
    group.broadcast(buf)
    first = [queue.get(timeout=60) for _ in procs]
    weights2 = {k: v + 1 for k, v in weights.items()}
    buf2, spec2 = flatten_weights(weights2)
    assert spec2 == spec  # same layout every refit: receivers keep their buffer
    buf.copy_(buf2)
    group.broadcast(buf)
    second = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    group.close()
    for got in first:
        assert all(torch.equal(got[k], weights[k]) for k in weights)
    for got in second:
        assert all(torch.equal(got[k], weights2[k]) for k in weights)


def test_plain_allocations_is_a_no_op_when_off():
    from agentrl.weights.transports import plain_allocations

    with plain_allocations(False):  # no CUDA needed: nothing is switched
        x = torch.ones(3)
    assert x.sum() == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_buffer_made_under_plain_allocations_is_a_plain_segment_another_process_opens():
    # learner.expandable_segments: the learner's allocator maps expandable segments, but the CUDA
    # IPC refit's buffer must be a plain allocation. In a process of its own (the setting is global).
    import subprocess
    import sys

    code = r'''
import pickle, subprocess, sys
import torch
from agentrl.weights.transports import ipc_handle, plain_allocations
torch.cuda.memory._set_allocator_settings("expandable_segments:True")
before = torch.ones(8 * 2**20, device="cuda")  # 32 MiB in an expandable segment
with plain_allocations():
    buf = torch.arange(4 * 2**20, dtype=torch.float32, device="cuda")
after = torch.ones(8 * 2**20, device="cuda")
torch.cuda.synchronize()
def segment_of(t):
    p = t.data_ptr()
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= p < seg["address"] + seg["total_size"]:
            return seg
kinds = [bool(segment_of(t).get("is_expandable")) for t in (before, buf, after)]
assert kinds == [True, False, True], kinds
child = "import pickle, sys, torch; from agentrl.weights.transports import open_ipc_handle; " \
        "t = open_ipc_handle(sys.stdin.buffer.read()); print(float(t[-1]), t.numel())"
out = subprocess.run([sys.executable, "-c", child], input=ipc_handle(buf), capture_output=True, check=True)
assert out.stdout.split() == [str(float(4 * 2**20 - 1)).encode(), str(4 * 2**20).encode()], out
print("ok")
'''
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]


def test_readers_guard_holds_the_optimizer_step_until_the_release() -> None:
    """refit.zero_copy: the optimizer step waits while engines read the parameters in place."""
    import threading
    import time as _time

    from agentrl.weights.transports import ReadersGuard

    guard = ReadersGuard(timeout_s=5.0)
    assert guard.wait() < 0.5  # nothing being read
    guard.begin(3)
    assert not guard.end(2)  # a late release of an older export does not end this one's reading
    timer = threading.Timer(0.3, guard.end, args=(3,))
    timer.start()
    t0 = _time.perf_counter()
    waited = guard.wait()
    assert 0.2 < waited and _time.perf_counter() - t0 >= 0.25
    short = ReadersGuard(timeout_s=0.05)
    short.begin(7)
    with pytest.raises(TimeoutError, match="export 7"):
        short.wait()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_zero_copy_refit_another_process_reads_the_parameters_in_place():
    # refit.zero_copy on the GPU: parameters gathered into one plain buffer (expandable segments on,
    # as learner.expandable_segments sets them), shared by one CUDA IPC handle; another process
    # rebuilds the strided views (a transposed one included) and sees every value, and a later
    # in-place update without sending anything new.
    import subprocess
    import sys

    code = r'''
import subprocess, sys
import torch
from agentrl.weights.transports import LazyReshape, describe_views, gather_parameters, ipc_handle, plain_allocations
torch.cuda.memory._set_allocator_settings("expandable_segments:True")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64)).cuda().to(torch.bfloat16)
with plain_allocations():
    buf = gather_parameters(model)
views = {"a.weight": model[0].weight, "a.bias": model[0].bias, "b.weight_t": LazyReshape(model[1].weight.t(), (96, 64))}
spec = describe_views(buf, views)
from agentrl.weights.transports import spec_to_bytes
import pickle
torch.cuda.synchronize()
child = r"""
import pickle, sys, torch
from agentrl.weights.transports import open_ipc_handle, spec_from_bytes, unflatten_weights
handle, spec = pickle.loads(sys.stdin.buffer.read())
buf = open_ipc_handle(handle)
print(" ".join(f"{n}:{float(t.float().sum()):.4f}:{tuple(t.shape)}".replace(" ", "") for n, t in unflatten_weights(buf, spec_from_bytes(spec))))
"""
def read():
    out = subprocess.run([sys.executable, "-c", child], input=pickle.dumps((ipc_handle(buf), spec_to_bytes(spec))),
                         capture_output=True, check=True)
    return out.stdout.decode().split()
def expect():
    return [f"{n}:{float(t.float().sum()):.4f}:{tuple(t.shape)}".replace(" ", "") for n, t in
            [("a.weight", model[0].weight), ("a.bias", model[0].bias), ("b.weight_t", model[1].weight.t().reshape(96, 64))]]
assert read() == expect(), (read(), expect())
with torch.no_grad():
    model[1].weight.mul_(2)
torch.cuda.synchronize()
assert read() == expect()
print("ok")
'''
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]
