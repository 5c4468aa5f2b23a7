"""ZeRO-Offload on one GPU: a GPT of a few billion parameters trains with ``offload_optimizer="cpu"``
under a GPU memory cap where it runs out of memory without offload.

    python benchmarks/gpu_offload_check.py                      # on a machine with one GPU
    python benchmarks/gpu_offload_check.py --cap-gb 40 --layers 32 --width 2560
    python benchmarks/gpu_offload_check.py --cpu-dry-run        # the same code path, tiny, on CPU

Each case runs in its own process (the cap and an out-of-memory error must not leak between them)
and prints one JSON line; the last line compares them. bf16-mixed Adam needs 16 bytes per
parameter on the device without offload and 4 with it (bf16 parameters and gradients), so a
2.7 B model (43 GB of model state) does not fit under a 40 GB cap but does with CPU offload.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    sys.path.insert(0, str(ROOT))
    from lightning_3d import ThreeDParallelStrategy
    from lightning_3d.data import TextDataModule
    from lightning_3d.models import GPTConfig, GPTModule

    L.seed_everything(0)
    gpu = not args.cpu_dry_run
    if gpu:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * 2**30 / total), 0)
    config = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    offload = {"offload_optimizer": "cpu"} if args.case == "offload" else {}
    strategy = ThreeDParallelStrategy(zero_stage=1, **offload)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, i) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check import one_device_trainer

    trainer = one_device_trainer(gpu, strategy, args.steps, Record())
    start = time.perf_counter()
    result = {"case": args.case, "parameters": config.num_parameters(), "cap_gb": args.cap_gb if gpu else None}
    try:
        trainer.fit(GPTModule(config, warmup_steps=1), TextDataModule(block_size=args.seq, batch_size=args.batch, max_bytes=2**22))
        result.update(ok=True, losses=[round(x, 4) for x in losses], seconds=round(time.perf_counter() - start, 1))
        if gpu:
            result["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    except torch.OutOfMemoryError as err:
        result.update(ok=False, error="CUDA out of memory: " + str(err).splitlines()[0][:200])
    print("RESULT " + json.dumps(result), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap-gb", type=float, default=40.0, help="GPU memory the process may use")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny model on the CPU: checks the script itself")
    parser.add_argument("--case", choices=["plain", "offload"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        child(args)
        return 0
    if args.cpu_dry_run:
        args.layers, args.width, args.heads, args.seq = 2, 64, 4, 32
    results = {}
    for case in ("plain", "offload"):
        cmd = [sys.executable, __file__, "--case", case, *sys.argv[1:]]
        if args.cpu_dry_run:
            cmd += ["--layers", "2", "--width", "64", "--heads", "4", "--seq", "32"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        results[case] = json.loads(line[7:]) if line else {"case": case, "ok": False, "error": proc.stderr[-2000:]}
        print(json.dumps(results[case]), flush=True)
    verdict = {
        "case": "gpu_offload_check",
        "plain_fits": results["plain"].get("ok"),
        "offload_trains": results["offload"].get("ok"),
        "offload_is_needed_and_works": (not results["plain"].get("ok")) and bool(results["offload"].get("ok")),
    }
    print(json.dumps(verdict), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
