"""Expert parallelism of one MoE layer (issue 34): on 2 and 4 ranks, each holding E / ep experts and
its own tokens, the outputs and gradients are the layer's on all the tokens in one process, under
strict communication mode (the counts exchanged on the device, uneven all-to-alls, nothing sent by
some ranks to others)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lightning_3d.moe import MoE
from lightning_3d.testing.harness import run_on_ranks

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 16, 4, 2, 6


def _layer(skew: bool, **kwargs: Any) -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, **kwargs)
    torch.nn.init.normal_(moe.router.gate.weight, std=0.5)
    if skew:  # every token prefers experts 0 and 1 (rank 0's at ep=2): the other ranks receive nothing
        with torch.no_grad():
            moe.router.gate.weight.zero_()
            moe.router.gate.weight[0, 0], moe.router.gate.weight[1, 0] = 40.0, 30.0
    return moe


def _inputs(world: int, skew: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(world * TOKENS, DIM)
    if skew:
        x[:, 0] = x[:, 0].abs() + 1.0  # feature 0 positive: experts 0 and 1 win everywhere
    return x, torch.randn(world * TOKENS, DIM)


def _arrays(out: torch.Tensor, x: torch.Tensor, moe: MoE) -> dict[str, Any]:
    """Results as numpy arrays (a tensor would cross the process boundary as a shared-memory handle)."""
    return {"out": out.detach().numpy(), "x_grad": x.grad.numpy(), "grads": {n: p.grad.numpy() for n, p in moe.named_parameters()}}


def reference(world: int, skew: bool, shared: int) -> dict[str, Any]:
    moe = _layer(skew, n_shared_experts=shared)
    x, w = _inputs(world, skew)
    x.requires_grad_()
    out = moe(x)
    (out * w).sum().backward()
    routed = sorted(set(moe.router(x).experts.flatten().tolist()))
    return {**_arrays(out, x, moe), "routed": routed}


def expert_parallel_rank(skew: bool, shared: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_3d.moe.expert_parallel import apply_expert_parallel

    world, rank = dist.get_world_size(), dist.get_rank()
    moe = _layer(skew, n_shared_experts=shared)
    apply_expert_parallel(moe, dist.group.WORLD)
    x, w = _inputs(world, skew)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    x = x[mine].clone().requires_grad_()
    out = moe(x)
    (out * w[mine]).sum().backward()
    return _arrays(out, x, moe)


@pytest.mark.parametrize(("world", "skew", "shared"), [(2, False, 1), (2, True, 0), (4, False, 0)], ids=["ep2", "ep2-one-sided", "ep4"])
def test_expert_parallel_layer_matches_one_process(world, skew, shared):
    ref = run_on_ranks(reference, 1, world, skew, shared, timeout=120)[0]
    ranks = run_on_ranks(expert_parallel_rank, world, skew, shared, timeout=300)
    local = EXPERTS // world
    for rank, got in enumerate(ranks):
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
        np.testing.assert_allclose(got["out"], ref["out"][mine], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["x_grad"], ref["x_grad"][mine], rtol=1e-5, atol=1e-6)
        for name in ("experts.gate_proj", "experts.up_proj", "experts.down_proj"):  # the group's rows: the whole sum
            np.testing.assert_allclose(got["grads"][name], ref["grads"][name][rank * local : (rank + 1) * local], rtol=1e-5, atol=1e-6)
    for name, full in ref["grads"].items():  # replicated weights: each rank's share of the sum
        if not name.startswith("experts."):
            np.testing.assert_allclose(sum(r["grads"][name] for r in ranks), full, rtol=1e-5, atol=1e-6, err_msg=name)
    assert ref["routed"] == ([0, 1] if skew else list(range(EXPERTS)))  # one-sided: rank 1's experts get no row


# -- through the strategy: ThreeDParallelStrategy(expert_parallel=E) on 4 ranks ---------------------------------
def _sgd_moe_gpt(skew: tuple[float, ...] = (), **overrides: Any) -> Any:
    """The MoE GPT of tests/test_moe.py under plain SGD: Adam's update hardly changes when a gradient
    is scaled (the experts' by 1 / ep, say), SGD's changes in proportion, so the losses see it.
    ``skew``: added to the first router logits of every token (top-k = its length) of a frozen router,
    so that those experts take every row; ``routed`` collects the experts any row went to."""
    from lightning_3d.models import GPTConfig, GPTModule
    from tests.helpers import TINY_GPT
    from tests.test_moe import MOE_GPT

    manual = overrides.pop("accumulate_manually", 0)

    class SGDGPT(GPTModule):
        routed: set[int] = set()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.5)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            """``accumulate_manually=k``: manual optimization, as users write it: one backward per batch
            (ZeRO-0 then reduces after every one), a clipped step every ``k`` batches."""
            loss = super().training_step(batch, batch_idx)
            if self.automatic_optimization:
                return loss
            self.manual_backward(loss / manual)
            if (batch_idx + 1) % manual == 0:
                optimizer = self.optimizers()
                self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
                optimizer.step()
                optimizer.zero_grad()
            return loss.detach()

        def configure_model(self) -> None:
            super().configure_model()
            for layer in self.modules():
                if isinstance(layer, MoE) and not layer.router._forward_hooks:
                    if skew:
                        offset = torch.zeros(layer.router.n_experts)
                        offset[: len(skew)] = torch.tensor(skew)
                        layer.router.gate.register_forward_hook(lambda m, i, out, offset=offset: out + offset.to(out))
                        layer.router.gate.weight.requires_grad_(False)  # (else the z-loss learns the skew away)
                    layer.router.register_forward_hook(lambda m, i, out: self.routed.update(out.experts.unique().tolist()))

    module = SGDGPT(GPTConfig(**{**TINY_GPT, **MOE_GPT, **({"top_k": len(skew)} if skew else {}), **overrides}))
    module.automatic_optimization = not manual
    return module


def _ep_fit(
    root: str | None, steps: int, ckpt_path: str | None = None, skew: tuple[float, ...] = (), callbacks: tuple[Any, ...] = (),
    model: dict[str, Any] | None = None, precision: str = "32-true", **strategy: Any,
) -> dict[str, Any]:
    """The SGD MoE GPT trained ``steps`` steps (``root``: save every 2 steps there): this rank's losses,
    the whole trained model's weights (gathered from every slice and shard; kept on rank 0) and the
    experts any token was routed to. ``skew``: added to the first router logits of every token
    (top-k = its length), so that those experts take every row."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_3d import ThreeDParallelStrategy
    from tests.helpers import LossRecorder, quiet_trainer, tiny_data

    L.seed_everything(0)
    recorder = LossRecorder()
    callbacks = [recorder, *callbacks]
    if root is not None:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{step}"))
    trainer = quiet_trainer(
        max_steps=steps, limit_val_batches=0, callbacks=callbacks, enable_checkpointing=root is not None,
        strategy=ThreeDParallelStrategy(**strategy), gradient_clip_val=None if (model or {}).get("accumulate_manually") else 1.0,
        precision=precision,
    )
    module = _sgd_moe_gpt(skew, **(model or {}))
    module.routed = set()
    trainer.fit(module, tiny_data(global_batch_size=8), ckpt_path=ckpt_path)
    from lightning_3d.checkpoint.dense_state import full_state_dict

    weights = {k: v.float().numpy() for k, v in full_state_dict(module).items()}  # (collective)
    return {"losses": recorder.losses, "weights": weights, "routed": sorted(module.routed)}


EP_STEPS = 4
EP_LAYOUTS = {  # 4 weight replicas: ep2 leaves 2 expert replicas per slice, ep4 one
    "ep2": dict(expert_parallel=2),
    "ep2_zero1": dict(expert_parallel=2, zero_stage=1),
    "ep2_zero3": dict(expert_parallel=2, zero_stage=3),
    "ep4_zero2": dict(expert_parallel=4, zero_stage=2),
    "ep4_zero3": dict(expert_parallel=4, zero_stage=3),  # (one rank per expert slice: FSDP2 divides once)
    "cp2_ep2": dict(data_parallel=2, context_parallel=2, expert_parallel=2),  # an expert group of cp peers
    "pp2_ep2_1f1b": dict(data_parallel=2, pipeline_parallel=2, expert_parallel=2, pipeline_schedule="1f1b"),
    "pp2_ep2_zb_v": dict(data_parallel=2, pipeline_parallel=2, expert_parallel=2, pipeline_schedule="zb_v"),
    "tp2_ep2": dict(data_parallel=2, tensor_parallel=2, expert_parallel=2),  # one expert per rank of ep x tp
    "tp2_zero3": dict(data_parallel=2, tensor_parallel=2, zero_stage=3),
    "tp2_sp_ep2": dict(data_parallel=2, tensor_parallel=2, sequence_parallel=True, expert_parallel=2, zero_stage=1),
}
PIPELINED = {"n_layer": 4, "moe_every": 1}  # pipelined cells: an MoE layer in each of zb_v's four pieces
# manual optimization with 2 batches a step: ZeRO-0 reduces each backward, so the second reduction meets an
# expert gradient reduced already (it was divided by ep twice), and a pipeline hands its stash over twice
MANUAL = {"accumulate_manually": 2}
MANUAL_LAYOUTS = {"ep2_manual": dict(expert_parallel=2), "pp2_ep2_manual": dict(data_parallel=2, pipeline_parallel=2, expert_parallel=2)}
DENSE_FIRST_STAGE = {"n_layer": 4, "moe_every": 4}  # at pp2, only the last stage has an MoE block


def _ep_world(root: str) -> dict[str, Any]:
    from tests.helpers import refusal_message, run_checks

    saved = f"{root}/ep2"
    checks: dict[str, Any] = {
        name: (lambda name=name, s=s: _ep_fit(None, EP_STEPS, model=PIPELINED if name.startswith("pp2") else None, **s))
        for name, s in EP_LAYOUTS.items()
    }
    for name, s in MANUAL_LAYOUTS.items():
        model = {**MANUAL, **(PIPELINED if name.startswith("pp2") else {})}
        checks[name] = lambda model=model, s=s: _ep_fit(None, EP_STEPS, model=model, **s)
    checks["saved"] = lambda: _ep_fit(saved, 2, expert_parallel=2)
    for ep in (1, 4):  # a fresh Trainer and model at another expert_parallel, from the ep2 checkpoint
        checks[f"resumed_ep{ep}"] = lambda ep=ep: _ep_fit(None, EP_STEPS, f"{saved}/step=2.ckpt", expert_parallel=ep)
    # a first stage without MoE blocks (review: it raised alone, and the other stage's ranks hung)
    checks["dense_stage"] = lambda: _ep_fit(None, EP_STEPS, model=DENSE_FIRST_STAGE, data_parallel=2, pipeline_parallel=2, expert_parallel=2)
    checks["ep3"] = lambda: refusal_message(lambda: _ep_fit(None, 1, expert_parallel=3))
    checks["dense"] = lambda: refusal_message(_dense_at_ep2)
    checks["guard"] = _moved_expert_slice
    return run_checks(checks)


def assert_same_weights(got: dict[str, Any], want: dict[str, Any], name: str, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    assert sorted(got) == sorted(want), name
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=rtol, atol=atol, err_msg=f"{name}: {key}")


def _moved_expert_slice() -> str:
    """Rank 2 moves its copy of an expert slice; rank 0 holds the same slice (its expert replica)."""
    from lightning_3d.plugins.replica_guard import ReplicaDivergence
    from tests.test_replica_guard import Perturb

    try:
        _ep_fit(None, 4, callbacks=(Perturb(2, 2, "model.blocks.1.mlp.experts.up_proj"),), expert_parallel=2, replica_check_every=1)
    except ReplicaDivergence as err:
        return str(err)
    return "not found"


def _dense_at_ep2() -> None:
    import lightning as L  # noqa: F401

    from lightning_3d import ThreeDParallelStrategy
    from tests.helpers import quiet_trainer, tiny_data, tiny_gpt

    quiet_trainer(max_steps=1, strategy=ThreeDParallelStrategy(expert_parallel=2)).fit(tiny_gpt(), tiny_data())


def test_expert_parallel_through_the_strategy_matches_one_process_and_reshards_its_checkpoints(tmp_path):
    """Issue 34: ep2 and ep4 taken from 4 data-parallel ranks, at ZeRO 0-3, give one process's losses
    (gradient clipping on: the global norm counts every expert slice once); an ep2 checkpoint resumes
    at ep1 and ep4 with the losses of continuing; a bad degree is refused before step 1."""
    from tests.helpers import result_of

    single = run_on_ranks(_ep_fit, 1, None, EP_STEPS, timeout=300)[0]
    pipelined = run_on_ranks(_ep_fit, 1, None, EP_STEPS, model=PIPELINED, timeout=300)[0]
    dense_first = run_on_ranks(_ep_fit, 1, None, EP_STEPS, model=DENSE_FIRST_STAGE, timeout=300)[0]
    manual = {name: run_on_ranks(_ep_fit, 1, None, EP_STEPS, model=model, timeout=300)[0] for name, model in (("plain", MANUAL), ("pp2", {**MANUAL, **PIPELINED}))}
    ranks = run_on_ranks(_ep_world, 4, str(tmp_path), timeout=900)

    def mean(name: str) -> list[float]:
        return [sum(step) / 4 for step in zip(*(result_of(rank, name)["losses"] for rank in ranks))]

    def same_weights(name: str, want: dict[str, Any] = single) -> None:  # SGD: a weight's update is lr x its gradient
        got = result_of(ranks[0], name)["weights"]
        if name.startswith("pp2") or name == "dense_stage":  # the last stage's (ranks 2 and 3) weights too
            got = {**got, **result_of(ranks[2], name)["weights"]}
        assert_same_weights(got, want["weights"], name)

    for name in EP_LAYOUTS:
        want = pipelined if name.startswith("pp2") else single
        np.testing.assert_allclose(mean(name), want["losses"], rtol=1e-5, err_msg=name)
        same_weights(name, want)
    for name in MANUAL_LAYOUTS:
        want = manual["pp2" if name.startswith("pp2") else "plain"]
        np.testing.assert_allclose(mean(name), want["losses"], rtol=1e-5, err_msg=name)
        same_weights(name, want)
    np.testing.assert_allclose(mean("dense_stage"), dense_first["losses"], rtol=1e-5)
    same_weights("dense_stage", dense_first)
    np.testing.assert_allclose(mean("saved"), single["losses"][:2], rtol=1e-5)
    for ep in (1, 4):
        np.testing.assert_allclose(mean(f"resumed_ep{ep}"), single["losses"][2:], rtol=1e-5, err_msg=f"resumed at ep{ep}")
        same_weights(f"resumed_ep{ep}")
    ep3 = result_of(ranks[0], "ep3")
    assert "expert_parallel=3 splits the experts over ranks taken from data_parallel=4" in ep3 and "does not divide" in ep3, ep3
    guard = [result_of(rank, "guard") for rank in ranks]
    assert all("diverged" in m and "at step 3" in m for m in guard), guard  # every rank stops together
    assert "expert data parallel copies of" in guard[0] and "model.blocks.1.mlp.experts.up_proj" in guard[0], guard[0]
    dense = result_of(ranks[0], "dense")
    assert "expert_parallel=2 splits the experts of mixture-of-experts layers, but the model has none" in dense, dense


SKEWS = {"one_expert_takes_every_token": (30.0,), "rank_1_receives_nothing": (30.0, 25.0)}


# make test-slow: make test runs the one-sided exchange at the layer (test_expert_parallel_layer_matches_one_process
# [ep2-one-sided]) and expert parallelism through the strategy (the 4-rank test above)
@pytest.mark.slow
@pytest.mark.parametrize("skew", list(SKEWS), ids=list(SKEWS))
def test_skewed_routing_trains_200_steps_at_ep2_without_a_hang_or_a_wrong_gradient(skew):
    """Issue 34's liveness case (Megatron-LM #5749: EP hangs after hundreds of steps when counts vary):
    every row goes to rank 0's experts, so rank 1's experts receive none, every step, for 200 steps,
    at dp2 x ep2 with ZeRO-1 under strict communication mode; losses and weights stay one process's."""
    steps, offsets = 200, SKEWS[skew]
    single = run_on_ranks(_ep_fit, 1, None, steps, None, offsets, timeout=600)[0]
    ranks = run_on_ranks(_ep_fit, 2, None, steps, None, offsets, timeout=900, expert_parallel=2, zero_stage=1)
    assert single["routed"] == list(range(len(offsets))) and all(r["routed"] == single["routed"] for r in ranks)
    mean = [sum(step) / 2 for step in zip(*(r["losses"] for r in ranks))]
    np.testing.assert_allclose(mean, single["losses"], rtol=1e-4)
    assert_same_weights(ranks[0]["weights"], single["weights"], skew, rtol=1e-3, atol=2e-5)  # (200 steps of fp32 drift)


MANUAL_SWEEP = {  # every ZeRO stage and degree with manual optimization, 2 batches a step (make test-slow)
    "ep2_zero1": dict(expert_parallel=2, zero_stage=1),
    "ep2_zero2": dict(expert_parallel=2, zero_stage=2),
    "ep2_zero3": dict(expert_parallel=2, zero_stage=3),
    "ep4_zero0": dict(expert_parallel=4),
    "ep4_zero3": dict(expert_parallel=4, zero_stage=3),
    "cp2_ep2": dict(data_parallel=2, context_parallel=2, expert_parallel=2),
    "tp2_ep2": dict(data_parallel=2, tensor_parallel=2, expert_parallel=2),
    "tp2_ep2_zero3": dict(data_parallel=2, tensor_parallel=2, expert_parallel=2, zero_stage=3),
    "tp2_sp_ep2": dict(data_parallel=2, tensor_parallel=2, sequence_parallel=True, expert_parallel=2, zero_stage=1),
    "pp2_ep2_zb_v": dict(data_parallel=2, pipeline_parallel=2, expert_parallel=2, pipeline_schedule="zb_v"),
    "pp2_ep2_zero1": dict(data_parallel=2, pipeline_parallel=2, expert_parallel=2, zero_stage=1),
}


def _manual_sweep_world() -> dict[str, Any]:
    from tests.helpers import run_checks

    def fit(name: str, strategy: dict[str, Any]) -> dict[str, Any]:
        return _ep_fit(None, EP_STEPS, model={**MANUAL, **(PIPELINED if name.startswith("pp2") else {})}, **strategy)

    return run_checks({name: (lambda name=name, s=s: fit(name, s)) for name, s in MANUAL_SWEEP.items()})


@pytest.mark.slow
def test_manual_optimization_at_every_zero_stage_and_degree_matches_one_process_under_sgd():
    """Each backward reduces under manual optimization, so a reducer that is not idempotent on an
    already reduced expert gradient shows here; SGD makes any gradient scale visible in the weights."""
    from tests.helpers import result_of

    want = {k: run_on_ranks(_ep_fit, 1, None, EP_STEPS, model=m, timeout=300)[0] for k, m in (("plain", MANUAL), ("pp2", {**MANUAL, **PIPELINED}))}
    ranks = run_on_ranks(_manual_sweep_world, 4, timeout=900)
    for name in MANUAL_SWEEP:
        ref = want["pp2" if name.startswith("pp2") else "plain"]
        losses = [sum(step) / 4 for step in zip(*(result_of(rank, name)["losses"] for rank in ranks))]
        np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5, err_msg=name)
        got = result_of(ranks[0], name)["weights"]
        if name.startswith("pp2"):  # the last stage's weights too
            got = {**got, **result_of(ranks[2], name)["weights"]}
        assert_same_weights(got, ref["weights"], name)
