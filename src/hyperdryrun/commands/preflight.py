"""The checks every command makes before it does any work: the environment it will read and every path it will
write. A run or a search takes seconds to hours; a bad variable or an unwritable output found after it loses the
work, and found half-way through writing it replaces a good earlier report with nothing (issue 23). So each command
calls these first, and a problem is one :class:`~hyperdryrun.config.ConfigError` line naming the variable or flag
and its value (exit code 2), with nothing written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hyperdryrun.config import ConfigError
from hyperdryrun.ingest.files import Limit

if TYPE_CHECKING:
    from hyperdryrun.config import JobConfig
    from hyperdryrun.world.runtime import CudaRuntime


WORLD_SIZE = Limit("HYPERDRYRUN_MAX_WORLD_SIZE", 65_536, "the world size a run simulates")
"""The largest world a run simulates (:func:`hyperdryrun.commands.job.check_host_cost`)."""


def check_limits(environ: Mapping[str, str] | None = None) -> None:
    """Every ``HYPERDRYRUN_MAX_*`` variable that is set is a positive integer (each bounds what one input may cost;
    a malformed one would otherwise surface only when the first file is read)."""
    from hyperdryrun.ingest.files import LIMITS

    for limit in (*LIMITS, WORLD_SIZE):
        try:
            limit.value(environ)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def check_job_environment(cfg: JobConfig, environ: Mapping[str, str] | None = None) -> None:
    """The variables a job's simulation reads, checked as the simulation will read them (see
    :func:`check_cuda_environment`). torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` are merged (and checked) with
    the job's flags before this."""
    check_cuda_environment(cfg.cuda, cfg.target_device, environ)


def check_cuda_environment(
    cuda: CudaRuntime | None, target_device: str | None, environ: Mapping[str, str] | None = None
) -> None:
    """For a CUDA target, the caching-allocator settings (``PYTORCH_CUDA_ALLOC_CONF`` and its aliases, unless
    ``--alloc-conf`` gives them) parsed by the code the step's world uses, exactly as ``--alloc-conf`` is checked
    when the job is built; ``CUBLAS_WORKSPACE_CONFIG`` and ``NCCL_BUFFSIZE`` are read leniently, as torch and NCCL
    read them (a value that does not parse falls back to the default, and the report's ``metadata.cuda`` says so)."""
    from hyperdryrun.allocator.options import AllocatorConfigError
    from hyperdryrun.world.runtime import CudaRuntime

    if target_device not in (None, "cuda"):
        return
    try:
        (cuda or CudaRuntime()).settings(environ)  # the one place the variables are resolved
    except AllocatorConfigError as err:
        raise ConfigError(str(err)) from None


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (the directory that will have to take the new entries)."""
    p = path
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def check_output_dir(path: str | os.PathLike, flag: str) -> None:
    """``path`` is a directory this process may write into, or one it can create: one line naming ``flag``
    otherwise."""
    p = Path(os.path.abspath(path))
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {str(path)!r}: cannot write into it (permission denied)")
        return
    if os.path.lexists(p):
        raise ConfigError(f"{flag} {str(path)!r}: exists and is not a directory")
    base = _nearest_existing(p)
    if not base.is_dir():
        raise ConfigError(f"{flag} {str(path)!r}: cannot create it, {str(base)!r} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {str(path)!r}: cannot create it in {str(base)!r} (permission denied)")


def check_output_file(path: str | os.PathLike, flag: str, make_parent: bool = False) -> None:
    """``path`` can be replaced by a new file (written beside it and renamed over it): not a directory, its parent
    an existing writable directory (or, with ``make_parent``, one that can be created)."""
    p = Path(os.path.abspath(path))
    shown = str(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {shown!r}: is a directory, not a file")
    if os.path.lexists(p) and not p.is_file():
        raise ConfigError(f"{flag} {shown!r}: exists and is not a regular file")
    parent = p.parent
    if make_parent and not parent.exists():
        check_output_dir(parent, flag)
        return
    if not parent.is_dir():
        raise ConfigError(f"{flag} {shown!r}: cannot write there, {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {shown!r}: cannot write there (permission denied on {str(parent)!r})")


def check_rank_outputs(
    output_dir: str | os.PathLike, ranks: Iterable[int], flag: str = "--output-dir"
) -> None:
    """Every file a run writes for ``ranks`` under ``output_dir`` (``rank_<r>/rank_<r>_memory.json`` and its CSVs)
    can be written."""
    from hyperdryrun.report.writer import rank_paths, segments_path

    check_output_dir(output_dir, flag)
    for r in ranks:
        json_path, csv_path = rank_paths(output_dir, r)
        check_output_dir(json_path.parent, flag)
        for path in (json_path, csv_path, segments_path(output_dir, r)):
            check_output_file(path, flag, make_parent=True)
