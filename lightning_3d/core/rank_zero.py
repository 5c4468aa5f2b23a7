"""One log line per event: facts every rank shares are logged (and warned about) by global rank zero.

The rule (docs/architecture.md): a message about the job -- its layout, its configuration, a
refused or ignored option -- goes through :func:`info` / :func:`warn` and appears once. A message
about one rank -- its failure, a dead peer it noticed, its own stall -- is logged directly by that
rank (``logging`` or stderr), so it is never lost behind rank zero.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch.distributed as dist


def global_rank() -> int:
    """This process's global rank: the process group's once it exists; before that, what Lightning
    (``rank_zero_only.rank``) or the launcher's environment (``RANK``, ``SLURM_PROCID``, ...) says."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", None)
    if rank is not None:
        return int(rank)
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def is_global_zero() -> bool:
    return global_rank() == 0


_said: set[tuple[str, str]] = set()  # (logger, message) already logged with once=True: a log cache, no state


def info(logger: logging.Logger, msg: str, *args: Any, once: bool = False) -> None:
    """``logger.info(msg, *args)`` on global rank zero only (a fact every rank shares). ``once``: not
    again in this process with the same text (the layout, logged by every fit/validate set-up)."""
    if not is_global_zero():
        return
    if once:
        key = (logger.name, msg % args if args else msg)
        if key in _said:
            return
        _said.add(key)
    logger.info(msg, *args)


def warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
    """``warnings.warn`` on global rank zero only (a fact every rank shares); ``stacklevel`` as there,
    counted from the caller."""
    if is_global_zero():
        warnings.warn(message, category, stacklevel=stacklevel + 1)


def quiet_deprecations_off_zero() -> None:
    """On every rank but global rank zero, ignore ``DeprecationWarning``/``FutureWarning``: they are
    about the code, which every rank runs alike (torch's and Lightning's own included), so rank zero's
    copy is the one line. Other warnings stay on every rank (they may be about that rank)."""
    if is_global_zero():
        return
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
