"""Strict communication mode: each of its three rules catches a deliberately wrong snippet that
plain gloo accepts, and lets the NCCL-correct version of the same snippet through."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_3d.testing import strict_comm as sc
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import result_of, run_checks


def _as_library_code(source: str) -> dict[str, Any]:
    """Compile ``source`` as if it were a lightning_3d module (rule a looks at who made a tensor)."""
    scope: dict[str, Any] = {"__name__": "lightning_3d.snippet", "torch": torch, "dist": dist}
    exec(compile(textwrap.dedent(source), "lightning_3d/snippet.py", "exec"), scope)
    return scope


_HOST_SNIPPETS = _as_library_code(
    """
    def no_device():
        dist.all_reduce(torch.zeros(3))

    def derived():
        header = torch.zeros(4, dtype=torch.int64)
        dist.broadcast(header[1:3].float() * 2, src=0)

    def moved_to_host(device):
        dist.all_reduce(torch.ones(3, device=device).cpu())

    def literal_cpu():
        dist.all_reduce(torch.ones(3, device="cpu"))

    def p2p_header(device):
        header = torch.zeros(2, dtype=torch.int64)
        peer = 1 - dist.get_rank()
        ops = [dist.P2POp(dist.isend, header, peer), dist.P2POp(dist.irecv, torch.zeros(2, dtype=torch.int64, device=device), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def offloaded_state(device):
        state = torch.ones(3, device=device)
        mark_host(state, "offloaded optimizer state")
        dist.all_reduce(state.pow(2).sum())

    def offloaded_reduce_scatter(device):
        grads = torch.ones(4, device=device)
        mark_host(grads, "a gradient bucket in host memory")
        dist.reduce_scatter_single(torch.empty(2, device=device), grads)  # torch 2.13's name

    def offloaded_all_gather(device):
        shard = torch.ones(2, device=device)
        mark_host(shard, "a parameter shard in host memory")
        dist.all_gather_single(torch.empty(4, device=device), shard)

    def offloaded_dtensor(device):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        shard = distribute_tensor(torch.ones(4, 2, device=device), init_device_mesh(device.type, (2,)), [Shard(0)])
        mark_host(shard, "a ZeRO-3 shard offloaded to the host")
        shard.full_tensor()  # DTensor gathers through the functional collectives

    def correct(device):
        flag = torch.zeros(3, device=device)
        dist.all_reduce(flag)
        dist.all_reduce(torch.zeros(3).to(device))
        dist.all_reduce(torch.ones(3, device=device) + torch.tensor(2.0))  # a host scalar joins a device tensor
        return float(flag.sum())
    """
)
_HOST_SNIPPETS["mark_host"] = sc.mark_host


def _expect_refusal(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except sc.StrictCommError as err:
        return str(err)
    return "accepted"


def _rule_a_world() -> dict[str, Any]:
    device = torch.device("cpu")
    s = _HOST_SNIPPETS
    plain = {"plain gloo accepts": lambda: (s["no_device"](), s["derived"](), "accepted")[-1]}
    strict = {
        "no device": lambda: _expect_refusal(s["no_device"]),
        "derived": lambda: _expect_refusal(s["derived"]),
        "moved to host": lambda: _expect_refusal(s["moved_to_host"], device),
        "literal cpu": lambda: _expect_refusal(s["literal_cpu"]),
        "p2p header": lambda: _expect_refusal(s["p2p_header"], device),
        "offloaded state": lambda: _expect_refusal(s["offloaded_state"], device),
        "offloaded dtensor": lambda: _expect_refusal(s["offloaded_dtensor"], device),
        "offloaded reduce_scatter_single": lambda: _expect_refusal(s["offloaded_reduce_scatter"], device),
        "offloaded all_gather_single": lambda: _expect_refusal(s["offloaded_all_gather"], device),
        "correct": lambda: s["correct"](device),
        "test code is not library code": lambda: (dist.all_reduce(torch.zeros(1)), "accepted")[-1],
    }
    out = run_checks(plain)
    with sc.strict_comm():
        out.update(run_checks(strict))
    return out


@pytest.fixture(scope="module")
def rule_a() -> list[dict[str, Any]]:
    return run_on_ranks(_rule_a_world, 2, timeout=120, strict=False)


def test_gloo_alone_accepts_host_tensors(rule_a: list[dict[str, Any]]) -> None:
    assert result_of(rule_a[0], "plain gloo accepts") == "accepted"


@pytest.mark.parametrize(
    "check, site",
    [
        ("no device", "snippet.py:3 (torch.zeros without device=)"),
        ("derived", "snippet.py:6 (torch.zeros without device=)"),
        ("moved to host", "snippet.py:10 (.cpu())"),
        ("literal cpu", "snippet.py:13 (host memory)"),
        ("p2p header", "snippet.py:16 (torch.zeros without device=)"),
        ("offloaded state", "offloaded optimizer state"),
        ("offloaded dtensor", "a ZeRO-3 shard offloaded to the host"),
        ("offloaded reduce_scatter_single", "a gradient bucket in host memory"),
        ("offloaded all_gather_single", "a parameter shard in host memory"),
    ],
)
def test_host_tensor_refused_with_its_call_site(rule_a: list[dict[str, Any]], check: str, site: str) -> None:
    for rank in rule_a:
        message = result_of(rank, check)
        assert "got a host tensor" in message and "NCCL accepts only tensors on the compute device" in message, message
        assert site in message, message


def test_device_tensors_pass(rule_a: list[dict[str, Any]]) -> None:
    assert [result_of(r, "correct") for r in rule_a] == [0.0, 0.0]
    assert result_of(rule_a[0], "test code is not library code") == "accepted"


# -- rule b: tags are dropped ---------------------------------------------------------------------------------
def _tagged_exchange(strict: bool, same_shape: bool) -> Any:
    """Rank 0 sends a then b; rank 1 receives b first, picking it out by its tag (gloo honours that)."""
    a, b = torch.full((4,), 1.0), torch.full((4 if same_shape else 6,), 2.0)
    with sc.strict_comm() if strict else _nothing():
        if dist.get_rank() == 0:
            works = [dist.isend(a, 1, tag=1), dist.isend(b, 1, tag=2)]
            for w in works:
                w.wait()
            return None
        got_b, got_a = torch.empty_like(b), torch.empty_like(a)
        works = [dist.irecv(got_b, 0, tag=2), dist.irecv(got_a, 0, tag=1)]
        errors = []
        for w in works:
            try:
                w.wait()
            except sc.StrictCommError as err:
                errors.append(str(err))
        return errors[0] if errors else [got_a.tolist(), got_b.tolist()]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _rule_b_world() -> dict[str, Any]:
    return {
        "plain": _tagged_exchange(False, True),
        "strict same shape": _tagged_exchange(True, True),
        "strict other shape": _tagged_exchange(True, False),
    }


def test_tags_are_dropped_and_mismatches_named() -> None:
    rank1 = run_on_ranks(_rule_b_world, 2, timeout=120, strict=False)[1]
    assert rank1["plain"] == [[1.0] * 4, [2.0] * 4]  # gloo matched by tag: the bug stays hidden
    for key in ("strict same shape", "strict other shape"):
        message = rank1[key]
        assert isinstance(message, str) and "tags are ignored" in message, message
        assert "tag 1" in message and "tag 2" in message, message
        assert "test_strict_comm.py" in message, message  # both call sites named
    assert "float32[4]" in rank1["strict other shape"] and "float32[6]" in rank1["strict other shape"]


# -- rule c: a send completes only when its receive runs -------------------------------------------------------
def _crossing(how: str) -> str:
    """Both ranks send to each other, then receive: fine with gloo's asynchronous sends, a deadlock on NCCL
    (each send waits for a receive posted behind it). Batched, the same exchange is correct."""
    peer = 1 - dist.get_rank()
    out, inbox = torch.full((8,), float(dist.get_rank())), torch.empty(8)
    try:
        if how == "isend then recv":
            work = dist.isend(out, peer)
            dist.recv(inbox, peer)
            work.wait()
        elif how == "send then recv":
            dist.send(out, peer)
            dist.recv(inbox, peer)
        else:  # batched
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, inbox, peer)]):
                work.wait()
    except sc.StrictCommError as err:
        return str(err)
    return f"received {inbox[0].item():.0f}"


def _rule_c_world(strict: bool) -> dict[str, str]:
    results = {}
    # a blocking gloo send already waits for its receive: plain gloo runs only the other two
    for how in ("batched", "isend then recv", "send then recv")[: 3 if strict else 2]:
        with sc.strict_comm(deadlock_after=3.0) if strict else _nothing():
            results[how] = _crossing(how)
        dist.barrier()
    return results


def test_rendezvous_turns_an_ordering_deadlock_into_an_error() -> None:
    plain = run_on_ranks(_rule_c_world, 2, False, timeout=120, strict=False)
    assert all(r == {k: f"received {1 - rank}" for k in r} for rank, r in enumerate(plain))  # gloo buffers
    strict = run_on_ranks(_rule_c_world, 2, True, timeout=120, strict=False)
    for rank, result in enumerate(strict):
        assert result["batched"] == f"received {1 - rank}"
        for how in ("isend then recv", "send then recv"):
            message = result[how]
            assert "waited 3 s" in message and "in posting order" in message, message
            assert f"send to rank {1 - rank}" in message, message


# -- what rule a found in the library ----------------------------------------------------------------------------
def _zero3_offload_norm() -> dict[str, Any]:
    from torch import nn

    from lightning_3d.core.topology import ParallelDims, Topology
    from lightning_3d.plugins.precision import _local, global_grad_norm
    from lightning_3d.zero.fsdp import apply_zero3

    topology = Topology.build(ParallelDims(dp=2), "cpu")
    with sc.strict_comm():
        model = nn.Module()
        model.body = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        apply_zero3(model, topology.dp_mesh, cpu_offload=True)
        model.body(torch.randn(4, 8)).sum().backward()
        grads = [_local(p.grad) for p in model.parameters()]
        return {
            "grad is host memory": _expect_refusal(dist.all_reduce, grads[0].pow(2).sum()),
            "norm": float(global_grad_norm(list(model.parameters()), topology, device=torch.device("cpu"))),
            "dense norm": float(torch.cat([g.reshape(-1) for g in grads]).pow(2).sum()),
        }


def test_zero3_cpu_offload_norm_is_reduced_on_the_compute_device() -> None:
    """FSDP2's offloaded gradients are host memory on a GPU machine: the clipping norm's partial sums
    must move to the compute device before they are all-reduced (before the fix they stayed with the
    gradients, and strict mode refused the all-reduce)."""
    ranks = run_on_ranks(_zero3_offload_norm, 2, timeout=120, strict=False)
    for r in ranks:
        assert "ZeRO-3 CPU offload" in r["grad is host memory"], r
    total = sum(r["dense norm"] for r in ranks) ** 0.5  # each rank holds half of every parameter
    assert ranks[0]["norm"] == pytest.approx(total, rel=1e-5) and ranks[1]["norm"] == pytest.approx(total, rel=1e-5)


def test_zero3_cpu_offload_keeps_optimizer_state_with_its_host_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_3d import ThreeDParallelStrategy

    monkeypatch.setattr(ThreeDParallelStrategy, "root_device", property(lambda self: torch.device("cuda", 0)))
    strategy = ThreeDParallelStrategy(zero_stage=3, offload_optimizer="cpu")
    strategy._zero = type("Zero", (), {"stage": 3, "offload_optimizer": "cpu", "offload_params": "none"})()
    assert strategy._optimizer_state_device() == torch.device("cpu")
    strategy._zero.stage = 2  # ZeRO 1/2 offload: the ZeroOptimizer keeps its own state; plain optimizers follow the device
    assert strategy._optimizer_state_device() == torch.device("cuda", 0)


def test_offloaded_masters_wait_for_their_uploads_before_the_host_writes_them() -> None:
    """The masters' asynchronous copies to the GPU (pinned memory) must be done before the next step or a
    checkpoint load writes those masters on the host."""
    from lightning_3d.zero.sharded_optimizer import ZeroOptimizer

    events: list[str] = []

    class Upload:
        def synchronize(self) -> None:
            events.append("synchronized")

    opt = ZeroOptimizer.__new__(ZeroOptimizer)
    opt._uploads = Upload()
    opt.buckets = []
    opt.store = None
    opt.load_dense_master({})
    assert events == ["synchronized"] and opt._uploads is None
    opt._await_uploads()
    assert events == ["synchronized"]  # once per upload


# -- streams: items finishing out of order, batches and collectives on one group ---------------------------------
def _streams_world() -> dict[str, Any]:
    import time

    rank, out = dist.get_rank(), {}
    pair = dist.new_group([0, 1])
    with sc.strict_comm(deadlock_after=3.0):
        # rank 0 sends to 1 then to 2; rank 1 receives late, so the second send completes first
        if rank == 0:
            works = [dist.isend(torch.full((4,), 1.0), 1), dist.isend(torch.full((4,), 2.0), 2)]
            for w in works:
                w.wait()
        else:
            if rank == 1:
                time.sleep(0.5)
            buf = torch.empty(4)
            dist.recv(buf, 0)
            out["received"] = buf.tolist()
        dist.barrier()
        # a batch, then a collective on the same group: NCCL runs the collective behind the batch, so a
        # peer that joins the collective before receiving deadlocks
        if rank == 0:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4), 1, pair)])
            try:
                dist.all_reduce(torch.zeros(1), group=pair)
                out["collective"] = "no error"
            except sc.StrictCommError as err:
                out["collective"] = str(err)
                with torch._C.DisableTorchFunction():  # let the peer go on: gloo's own all-reduce
                    sc._ORIGINAL["all_reduce"](torch.zeros(1), group=pair)
            for w in works:
                w.wait()
        elif rank == 1:
            dist.all_reduce(torch.zeros(1), group=pair)
            dist.recv(torch.empty(4), 0, group=pair)
        dist.barrier()
    return out


def test_items_finishing_out_of_order_and_a_collective_behind_a_batch() -> None:
    ranks = run_on_ranks(_streams_world, 3, timeout=120, strict=False)
    assert ranks[1]["received"] == [1.0] * 4 and ranks[2]["received"] == [2.0] * 4
    message = ranks[0]["collective"]
    assert "before torch.distributed.all_reduce on the same group" in message, message
