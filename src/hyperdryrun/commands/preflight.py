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


def check_world_size(size: int, flag: str) -> None:
    """``size`` ranks are within :data:`WORLD_SIZE` (``fit`` lays out a world as ``run`` simulates one)."""
    from hyperdryrun.bounds import shown_number

    try:
        limit = WORLD_SIZE.value()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if size > limit:
        raise ConfigError(
            f"{flag} {shown_number(size)}: is more than the limit of {limit} ranks ({WORLD_SIZE.hint}); the "
            "simulated world's setup grows with it"
        )


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


NAME_MAX, PATH_MAX = 255, 4096
"""The longest file name (bytes, one path component) and path Linux and macOS file systems take."""


def check_name(path: str | os.PathLike, flag: str) -> None:
    """Every component of ``path`` is a name the file system can take (at most :data:`NAME_MAX` bytes, the path
    :data:`PATH_MAX`), and the path holds no NUL: otherwise the write fails with ``File name too long`` after the
    work."""
    text = os.fspath(path)
    if str(text) == "-":
        raise ConfigError(f"{flag} '-': writes a file, not stdout; name a file (./- for one named '-')")
    if "\0" in str(text):
        raise ConfigError(f"{flag} {str(text)!r}: a path cannot hold a NUL character")
    raw = os.fsencode(os.path.abspath(text))
    if len(raw) >= PATH_MAX:
        raise ConfigError(
            f"{flag} {str(text)[:60]!r}...: the path is {len(raw)} bytes; the limit is {PATH_MAX - 1}"
        )
    for part in raw.split(b"/"):
        if len(part) > NAME_MAX:
            name = os.fsdecode(part)
            raise ConfigError(
                f"{flag} {str(text)[:60]!r}...: the name {name[:40]!r}... is {len(part)} bytes; a file name may have at "
                f"most {NAME_MAX}"
            )


def check_output_dir(path: str | os.PathLike, flag: str) -> None:
    """``path`` is a directory this process may write into, or one it can create: one line naming ``flag``
    otherwise."""
    check_name(path, flag)
    try:
        _check_output_dir(path, flag)
    except OSError as err:  # a stat refused on the way (a directory above it without search permission)
        raise ConfigError(f"{flag} {str(path)!r}: cannot write there ({err.strerror or err})") from None


def _check_output_dir(path: str | os.PathLike, flag: str) -> None:
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


def files_read(path: str | os.PathLike) -> list[Path]:
    """The files that reading the input ``path`` may open: the file itself and the report pair beside it (a
    report's ``.json`` reads its ``.csv``, and the reverse); for a run's output directory, every
    ``rank_<r>/`` file in it. Only those that exist."""
    p = Path(path)
    if p.is_dir():
        return sorted(f for f in p.glob("rank_*/rank_*") if f.is_file())
    pair = [p, p.with_suffix(".csv"), p.with_suffix(".json")] if p.suffix in (".json", ".csv") else [p]
    return [f for f in pair if f.is_file()]


def check_not_input(path: str | os.PathLike, flag: str, inputs: Iterable[str | os.PathLike | None]) -> None:
    """``path`` is none of the files the command reads (:func:`files_read` of each input; the same file by any
    name: a symlink, a hard link, ``./x``): a report written over its own input would replace a good report with
    something else (issue 30)."""
    if not os.path.lexists(path):
        return
    for given in inputs:
        if given is None:
            continue
        for f in files_read(given):
            try:
                same = os.path.samefile(path, f)
            except OSError:
                same = os.path.realpath(path) == os.path.realpath(f)
            if same:
                which = (
                    repr(str(given)) if Path(f) == Path(given) else f"{str(f)!r}, read with {str(given)!r}"
                )
                raise ConfigError(
                    f"{flag} {str(path)!r}: is an input of this command ({which}); writing it would replace what is "
                    "read: name another file"
                )


def check_output_file(
    path: str | os.PathLike,
    flag: str,
    make_parent: bool = False,
    inputs: Iterable[str | os.PathLike | None] = (),
) -> None:
    """``path`` can be replaced by a new file (written beside it and renamed over it): not a directory, not one of
    the files read from ``inputs`` (:func:`check_not_input`), its parent an existing writable directory (or, with
    ``make_parent``, one that can be created)."""
    check_name(path, flag)
    try:
        check_not_input(path, flag, inputs)
        _check_output_file(path, flag, make_parent)
    except OSError as err:  # a stat refused on the way (a directory above it without search permission)
        raise ConfigError(f"{flag} {str(path)!r}: cannot write there ({err.strerror or err})") from None


def _check_output_file(path: str | os.PathLike, flag: str, make_parent: bool) -> None:
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
    output_dir: str | os.PathLike,
    ranks: Iterable[int],
    flag: str = "--output-dir",
    inputs: Mapping[str, str | os.PathLike | None] | None = None,
) -> None:
    """Every file a run writes for ``ranks`` under ``output_dir`` (``rank_<r>/rank_<r>_memory.json`` and its CSVs,
    the error report beside) can be written, and none is one of the files the job reads (``inputs``: the flag that
    names each, ``{"--config": "job.yaml"}``; the same file by any name)."""
    from hyperdryrun.report.writer import error_path, rank_paths, segments_path

    check_output_dir(output_dir, flag)
    for r in ranks:
        json_path, csv_path = rank_paths(output_dir, r)
        check_output_dir(json_path.parent, flag)
        for path in (json_path, csv_path, segments_path(output_dir, r), error_path(output_dir, r)):
            check_output_file(path, flag, make_parent=True)
            _not_read(path, flag, output_dir, inputs or {})


def _not_read(
    path: Path, flag: str, output_dir: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None]
) -> None:
    if not os.path.lexists(path):
        return
    for input_flag, given in inputs.items():
        if given is None or not os.path.isfile(given):
            continue
        try:
            same = os.path.samefile(path, given)
        except OSError:
            same = os.path.realpath(path) == os.path.realpath(given)
        if same:
            raise ConfigError(
                f"{flag} {str(output_dir)!r}: would write {str(path)!r} over {input_flag} {str(given)!r}, an input "
                "of this command: name another output directory"
            )


def job_inputs(args: object, cfg: JobConfig | None = None) -> dict[str, str | None]:
    """The files a built-in job reads, by the flag that names them: ``--config`` and an HF config.json
    (``--model hf:PATH``, from the flag or the job file)."""
    inputs: dict[str, str | None] = {"--config": getattr(args, "config", None)}
    name = cfg.model.name if cfg is not None else getattr(args, "model", None)
    if isinstance(name, str) and name.startswith("hf:"):
        from hyperdryrun.models.hf import config_path

        try:
            inputs["--model"] = str(config_path(name))
        except ConfigError:
            pass  # refused where the model is built, naming it
    return inputs
