"""Context parallelism (cp) on CPU ranks: what splitting one sequence over 2 ranks costs and saves.

* :func:`cp_vs_cp1` trains a Llama-style GPT (GQA, SwiGLU, RMSNorm, RoPE) on 2,048-token
  sequences at cp=1 (one rank), cp=2 ring and cp=2 all-to-all, alternating the three runs, and
  quotes tokens/s and memory per rank as ratios. Memory is measured three ways because on CPU the
  usual number hides what cp divides: ``TokenThroughput.peak_memory_mb`` is the process's peak RSS
  (``ru_maxrss``), which includes the ~0.3-0.5 GB of the interpreter, torch and gloo; the RSS growth
  during fit is closer to the training tensors; the saved activations of one step
  (``MemoryProbe``, counted by storage through autograd's saved-tensor hooks) are what cp claims
  to divide.
* :func:`cp_attention_kernels` times attention alone, forward + backward, at the same total
  sequence: our ring and all-to-all attention on 2 ranks vs one process's SDPA. It also tries
  torch's own ring attention (``torch.distributed.tensor.experimental.context_parallel``) on the
  same 2 ranks and records the error it raises on CPU.

CPU threads: the strategy gives each local rank ``cpu_count // ranks`` threads, so cp=1 gets all
the cores in one process and cp=2 gets half of them per rank: the same cores either way. Under
``run_on_ranks`` (which sets ``OMP_NUM_THREADS=1``, so the strategy leaves threads alone) both
cases apply that rule themselves. Both cases use fewer steps than ``--steps`` (a quarter,
at least 4): one 2,048-token step takes about a second here.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
import traceback
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_3d.data import TextDataModule
from lightning_3d.models import GPTConfig, GPTModule
from lightning_3d.monitoring.callbacks import MemoryProbe, TokenThroughput
from lightning_3d.testing.harness import run_on_ranks

CP_GPT = dict(
    vocab_size=256,
    block_size=2048,
    n_layer=4,
    n_head=8,
    n_kv_head=2,
    n_embd=256,
    mlp="swiglu",
    norm="rmsnorm",
    position="rope",
    bias=False,
    tie_embeddings=False,
    dropout=0.0,
)
CP_BATCH = 1  # sequences per step; every cp rank loads the same ones and keeps its share of each
KERNEL_SHAPE = dict(batch=1, heads=8, kv_heads=2, seq=4096, head_dim=64)
MB = 2**20


def _rss_mb() -> float:
    """Current resident set size of this process (Linux /proc), in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def _peak_rss_mb() -> float:
    """This process's peak RSS so far (Linux reports ru_maxrss in KiB): what TokenThroughput reports on CPU."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _RssAtStart(L.Callback):
    """RSS when training starts (model built and sharded, no step run yet): the base of the growth."""

    def __init__(self) -> None:
        self.mb = float("nan")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.mb = _rss_mb()


def fit_cp(cp: int, mode: str, steps: int, warmup: int, threads: int = 0) -> dict[str, float]:
    """Runs on every rank: tokens/s and this rank's memory for ``steps`` training steps of CP_GPT at cp=``cp``
    (``threads``: per rank; 0 = the strategy's rule, cores // ranks)."""
    from cases import bench_trainer

    from lightning_3d import ThreeDParallelStrategy

    # The strategy would give each local rank cpu_count // ranks threads, but run_on_ranks sets
    # OMP_NUM_THREADS=1, which the strategy respects; apply the strategy's rule here instead.
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    L.seed_everything(0)
    throughput, probe, base = TokenThroughput(warmup=warmup), MemoryProbe(step=1), _RssAtStart()
    kwargs: dict[str, Any] = dict(context_parallel=cp, context_parallel_mode=mode) if cp > 1 else {}
    trainer = bench_trainer(ThreeDParallelStrategy(**kwargs), steps + warmup, [throughput, probe, base])
    model = GPTModule(GPTConfig(**CP_GPT), warmup_steps=2)
    model.configure_callbacks = lambda: []  # keep our instances
    data = TextDataModule(block_size=CP_GPT["block_size"], global_batch_size=CP_BATCH, max_bytes=2**21)
    trainer.fit(model, data)
    peak = _peak_rss_mb()
    return {
        "tokens_per_s": throughput.mean_tokens_per_s,
        "step_time_s": CP_BATCH * CP_GPT["block_size"] / throughput.mean_tokens_per_s,
        "rss_peak_mb": peak,
        "rss_growth_mb": peak - base.mb,
        "saved_activations_mb": probe.measured.get("activations", float("nan")) / MB,
        "model_state_mb": (probe.measured.get("total", 0.0) - probe.measured.get("activations", 0.0)) / MB,
        "threads": float(torch.get_num_threads()),
    }


def _summary(runs: list[list[dict[str, float]]]) -> dict[str, float]:
    """Median speed over repeats; memory: the largest rank of the largest repeat (per-rank peaks)."""
    return {
        "tokens_per_s": round(statistics.median(r[0]["tokens_per_s"] for r in runs), 1),
        "step_time_s": round(statistics.median(r[0]["step_time_s"] for r in runs), 3),
        "rss_peak_mb_per_rank": round(max(x["rss_peak_mb"] for r in runs for x in r), 1),
        "rss_growth_mb_per_rank": round(max(x["rss_growth_mb"] for r in runs for x in r), 1),
        "saved_activations_mb_per_rank": round(max(x["saved_activations_mb"] for r in runs for x in r), 2),
        "model_state_mb_per_rank": round(max(x["model_state_mb"] for r in runs for x in r), 2),
        "threads_per_rank": int(runs[0][0]["threads"]),
    }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3)


def cp_vs_cp1(steps: int, repeats: int) -> dict[str, Any]:
    """cp=2 (ring, all-to-all) vs cp=1 at 2,048 tokens, alternating the runs ``repeats`` times.

    ``cp1_1_thread`` is cp=1 on one core. It is not the comparison (cp1 uses both cores); it shows how
    well one process uses the second core here: on a loaded 2-core machine, one process's two threads
    can run slower than one thread, and then cp2's ratio over cp1 overstates what cp itself gains."""
    steps, warmup = max(4, steps // 4), 2
    specs = {
        "cp1": (1, "ring", 0),
        "cp2_ring": (2, "ring", 0),
        "cp2_all_to_all": (2, "all_to_all", 0),
        "cp1_1_thread": (1, "ring", 1),
    }
    runs: dict[str, list[list[dict[str, float]]]] = {label: [] for label in specs}
    for _ in range(repeats):
        for label, (cp, mode, threads) in specs.items():
            runs[label].append(run_on_ranks(fit_cp, cp, cp, mode, steps, warmup, threads, timeout=900))
    result = {label: _summary(rs) for label, rs in runs.items()}
    one, ring, a2a = result["cp1"], result["cp2_ring"], result["cp2_all_to_all"]
    out: dict[str, Any] = {
        "case": "cp2_vs_cp1",
        "model": CP_GPT,
        "global_batch": CP_BATCH,
        "tokens_per_step": CP_BATCH * CP_GPT["block_size"],
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "machine": f"{os.cpu_count()} CPU cores, gloo; threads per rank = cores / ranks (same cores in total)",
        **result,
    }
    for label, r in (("ring", ring), ("all_to_all", a2a)):
        out[f"cp2_{label}_tokens_per_s_ratio"] = _ratio(r["tokens_per_s"], one["tokens_per_s"])
        out[f"cp2_{label}_saved_activations_ratio"] = _ratio(r["saved_activations_mb_per_rank"], one["saved_activations_mb_per_rank"])
        out[f"cp2_{label}_rss_growth_ratio"] = _ratio(r["rss_growth_mb_per_rank"], one["rss_growth_mb_per_rank"])
        out[f"cp2_{label}_rss_peak_ratio"] = _ratio(r["rss_peak_mb_per_rank"], one["rss_peak_mb_per_rank"])
    out["cp1_2_threads_vs_1_thread_tokens_per_s_ratio"] = _ratio(one["tokens_per_s"], result["cp1_1_thread"]["tokens_per_s"])
    out["ring_vs_all_to_all_tokens_per_s_ratio"] = _ratio(ring["tokens_per_s"], a2a["tokens_per_s"])
    out["ring_vs_all_to_all_saved_activations_ratio"] = _ratio(
        ring["saved_activations_mb_per_rank"], a2a["saved_activations_mb_per_rank"]
    )
    return out


# -- attention alone ---------------------------------------------------------------------------------------------
def _qkv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full-sequence q, k, v of KERNEL_SHAPE, the same on every rank."""
    s = KERNEL_SHAPE
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s["batch"], s["heads"], s["seq"], s["head_dim"], generator=g)
    k = torch.randn(s["batch"], s["kv_heads"], s["seq"], s["head_dim"], generator=g)
    v = torch.randn(s["batch"], s["kv_heads"], s["seq"], s["head_dim"], generator=g)
    return q, k, v


def _time_fwd_bwd(attend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iters: int) -> float:
    """Median seconds of attend(q, k, v) forward + backward (ranks synchronized around each iteration)."""
    times = []
    for i in range(iters + 1):
        a, b, c = (x.detach().requires_grad_(True) for x in (q, k, v))
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        attend(a, b, c).sum().backward()
        if dist.is_initialized():
            dist.barrier()
        if i:  # the first one warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def one_process_sdpa(iters: int, threads: int) -> dict[str, float]:
    """One rank: torch's causal SDPA (the CPU flash kernel) over the whole sequence. With all cores it is
    what cp replaces; with one thread it is the serial work, against which 2 x a cp rank's time is the
    ring's extra work (chunk pairs, log-sum-exp merges, fp32 accumulators, waiting on the ring)."""
    torch.set_num_threads(threads)
    return {"seconds": _time_fwd_bwd(_sdpa, *_qkv(), iters), "threads": float(torch.get_num_threads())}


def ours_on_cp_ranks(iters: int) -> dict[str, Any]:
    """Every cp rank: our ring and all-to-all attention on its load-balanced share, plus the largest
    difference from one process's SDPA output; then torch's context_parallel on the same ranks."""
    from lightning_3d.context_parallel.layout import shard_sequence
    from lightning_3d.context_parallel.ring import ring_attention
    from lightning_3d.context_parallel.ulysses import all_to_all_attention

    cp, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))
    q, k, v = _qkv()
    local = [shard_sequence(x, 2, rank, cp) for x in (q, k, v)]
    group = dist.group.WORLD
    reference = shard_sequence(_sdpa(q, k, v), 2, rank, cp)
    out: dict[str, Any] = {"threads": torch.get_num_threads()}
    for name, fn in (("ring", ring_attention), ("all_to_all", all_to_all_attention)):
        attend = lambda a, b, c, fn=fn: fn(a, b, c, group)  # noqa: E731
        out[name] = _time_fwd_bwd(attend, *local, iters)
        out[f"{name}_max_abs_diff"] = float((attend(*local) - reference).abs().max())
    out["torch_context_parallel"] = torch_context_parallel(q, k, v, iters)
    return out


def torch_context_parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iters: int) -> dict[str, Any]:
    """torch's ring attention (``context_parallel``: SDPA patched to run over DTensor) on the cp ranks.
    Its handlers cover CUDA's flash / efficient / cuDNN SDPA ops only, so on CPU it is expected to
    fail; the error is returned, for the default SDPA backend and for the math one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))  # torch's CP has no GQA
    out: dict[str, Any] = {}
    for backend in ("default", "math"):
        buffers = [x.clone() for x in (q, k, v)]
        try:
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(buffers)):
                if backend == "math":
                    with sdpa_kernel(SDPBackend.MATH):
                        seconds = _time_fwd_bwd(_sdpa, *buffers, iters)
                else:
                    seconds = _time_fwd_bwd(_sdpa, *buffers, iters)
            out[backend] = {"ran": True, "seconds": seconds}
        except Exception as e:  # noqa: BLE001 (the outcome is the result)
            lines = traceback.format_exception_only(type(e), e)
            out[backend] = {"ran": False, "error": "".join(lines).strip().splitlines()[-1][:400]}
    return out


def cp_attention_kernels(steps: int, repeats: int) -> dict[str, Any]:
    """Attention forward + backward at one total sequence: our ring / all-to-all on 2 ranks vs one
    process's SDPA (alternated ``repeats`` times), and whether torch's context_parallel runs on CPU."""
    iters = max(3, steps // 6)
    sdpa, serial, ring, a2a, diffs, torch_cp = [], [], [], [], [], None
    threads: dict[str, int] = {}
    for _ in range(repeats):
        one = run_on_ranks(one_process_sdpa, 1, iters, os.cpu_count() or 1, timeout=600)[0]
        single = run_on_ranks(one_process_sdpa, 1, iters, 1, timeout=600)[0]
        ranks = run_on_ranks(ours_on_cp_ranks, 2, iters, timeout=600)
        sdpa.append(one["seconds"])
        serial.append(single["seconds"])
        ring.append(max(r["ring"] for r in ranks))
        a2a.append(max(r["all_to_all"] for r in ranks))
        diffs.append(max(max(r["ring_max_abs_diff"], r["all_to_all_max_abs_diff"]) for r in ranks))
        torch_cp = ranks[0]["torch_context_parallel"]
        threads = {"sdpa_1_rank": int(one["threads"]), "cp2_per_rank": int(ranks[0]["threads"])}
    series = (("sdpa_1_rank", sdpa), ("sdpa_1_rank_1_thread", serial), ("ring_cp2", ring), ("all_to_all_cp2", a2a))
    ms = {name: round(statistics.median(xs) * 1e3, 1) for name, xs in series}
    return {
        "case": "cp_attention_kernels",
        "shape": KERNEL_SHAPE,
        "iters": iters,
        "repeats": repeats,
        "machine": f"{os.cpu_count()} CPU cores, gloo",
        "threads": threads,
        "fwd_bwd_ms": ms,
        "ring_vs_sdpa_time_ratio": _ratio(ms["ring_cp2"], ms["sdpa_1_rank"]),
        "all_to_all_vs_sdpa_time_ratio": _ratio(ms["all_to_all_cp2"], ms["sdpa_1_rank"]),
        "ring_vs_all_to_all_time_ratio": _ratio(ms["ring_cp2"], ms["all_to_all_cp2"]),
        # cp ranks x a rank's time over one thread's time: > 1 is the work cp adds (1.0: none)
        "ring_work_vs_serial_sdpa_ratio": _ratio(2 * ms["ring_cp2"], ms["sdpa_1_rank_1_thread"]),
        "all_to_all_work_vs_serial_sdpa_ratio": _ratio(2 * ms["all_to_all_cp2"], ms["sdpa_1_rank_1_thread"]),
        "max_abs_diff_vs_sdpa": max(diffs),
        "torch_context_parallel": torch_cp,
    }
