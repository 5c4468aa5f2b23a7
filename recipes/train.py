"""Train the reference GPT from the Hydra configs in ``lightning_3d/conf/`` (``--config-dir`` overrides).

    python recipes/train.py                                  # defaults: local CPU, dp over 2 ranks
    python recipes/train.py parallel.data_parallel=2 trainer.max_steps=50
    python recipes/train.py model=gpt_small cluster=local_cpu trainer.precision=bf16-mixed
    python recipes/train.py -m parallel=dp seed=1,2          # a sweep: each job's ranks write under its
                                                             # sweep directory (hydra.sweep.dir/<job>)

``cfg.parallel`` keys are ``ThreeDParallelStrategy``'s keywords. Ends with a one-line JSON summary.
"""

import json
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import lightning_3d  # noqa: F401  (registers the "3d" strategy)
from lightning_3d.apps.cli import user_errors
from lightning_3d.apps.recipe import end_multirun_job, check_command_line, train
from lightning_3d.core.compose import CONF_DIR
from lightning_3d.resilience.preemption import EXIT_CODE, TrainingInterrupted


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run = HydraConfig.get()
    try:
        summary = train(cfg, Path(run.runtime.output_dir))
    except TrainingInterrupted as interrupted:  # SIGTERM from a scheduler: checkpoint written, say so, exit 143
        print(interrupted, file=sys.stderr, flush=True)
        sys.exit(EXIT_CODE)
    except user_errors() as err:  # a setting the user passed: one line naming it, exit 2 (Hydra would print a traceback)
        if os.environ.get("LIGHTNING_3D_TRACEBACK") == "1":
            raise
        print(f"recipes/train.py: error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        sys.exit(2)
    if run.mode == RunMode.MULTIRUN:  # the sweep's next job runs in this process: it launches its own ranks
        end_multirun_job()
    if summary is not None:
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    problem = check_command_line(sys.argv[1:])
    if problem is not None:  # one line and exit 2, as the CLI does, before Hydra prints a traceback
        print(f"recipes/train.py: error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
