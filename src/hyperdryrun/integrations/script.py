"""Your own training script as a job: a Python file or ``module:function`` that gives :func:`hyperdryrun.simulate`'s
arguments, dry-run as rank r of N (``hyperdryrun script``).

The contract, in the script (no HyperDryRun import needed)::

    def hyperdryrun_job(launch):            # launch.world_size, .rank, .local_rank, .layout
        return dict(model_fn=..., batch_fn=..., loss_fn=..., parallelize_fn=..., optimizer_fn=...,
                    mesh_shape=..., mesh_dim_names=..., num_micro_batches=...)

    def hyperdryrun_layouts(world_size):    # optional: the layouts `--fit` may try, preferred first
        return [{"tp": 1}, {"tp": 2}]

The dict holds :func:`~hyperdryrun.engine.simulate`'s keywords (``model_fn`` and ``batch_fn`` included) and
optionally ``rank_class``: ranks whose jobs return the same ``rank_class`` have, in the script's word, the same
memory (``--all-ranks`` then simulates one of them). The world comes from the command line or torchrun's variables,
which are also set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) while the job is built and simulated, as under torchrun.

A script that defines no ``hyperdryrun_job`` but calls ``hyperdryrun.simulate(...)`` at its top level (the README's
Python API example) is taken as it is: its first call's arguments are the job, its ``world_size``/``rank``/
``local_rank`` the defaults that the command line and torchrun's variables override, and nothing after the call runs.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperdryrun.config import ConfigError

JOB_FUNCTION = "hyperdryrun_job"
"""The function a script defines: ``hyperdryrun_job(launch) -> dict`` of simulate()'s arguments."""
LAYOUTS_FUNCTION = "hyperdryrun_layouts"
"""The optional function beside it: ``hyperdryrun_layouts(world_size) -> list[dict]``, the layouts ``--fit`` tries."""
IDENTITY = ("world_size", "rank", "local_rank")
"""simulate()'s keywords that the launch decides (the command line, torchrun's variables)."""
RUNTIME = ("target_device", "cuda")
"""simulate()'s keywords that the command line's --target-device / --gpu / --alloc-conf override."""
PLAN_KEYS = (
    "model_fn",
    "batch_fn",
    "loss_fn",
    "step_fn",
    "parallelize_fn",
    "optimizer_fn",
    "init_fn",
    "mesh_shape",
    "mesh_dim_names",
    "num_micro_batches",
    "metadata",
    "held_fn",
)
"""The keys of a job's dict that go to the plan as they are (``engine.PlanArgs`` and simulate()'s positionals)."""
RANK_CLASS = "rank_class"


class ScriptError(ConfigError):
    """The script cannot give a job (no such file, function or key; its code raised): one line, bad input."""


@dataclass(frozen=True)
class Launch:
    """What a job function is given: the rank it is, as torchrun would launch it, and under ``--fit`` the layout
    to build (``{}`` otherwise)."""

    world_size: int
    rank: int
    local_rank: int
    layout: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class LoadedScript:
    """A script executed once in this process: its job function, or the arguments of its simulate() call."""

    spec: str
    label: str
    """The script as a user names it: ``train.py``, ``train.py:make_job``, ``pkg.train:make_job``."""
    function: Callable[..., Any] | None = None
    layouts_function: Callable[..., Any] | None = None
    captured: dict[str, Any] | None = None
    """simulate()'s arguments, as keywords, of a script that calls it at its top level."""

    @property
    def mode(self) -> str:
        return "simulate() call" if self.captured is not None else "job function"


class _Captured(BaseException):
    """Raised by the stand-in for simulate() to stop the script there (a BaseException: a script's ``except
    Exception`` does not swallow it)."""

    def __init__(self, args: tuple, kwargs: dict[str, Any]) -> None:
        super().__init__("simulate() called")
        self.call_args, self.call_kwargs = args, kwargs


def _capture(*args: Any, **kwargs: Any) -> Any:
    raise _Captured(args, kwargs)


@contextlib.contextmanager
def _simulate_captured() -> Iterator[None]:
    """``hyperdryrun.simulate`` (and ``hyperdryrun.engine.simulate``) stop the script and hand over their arguments,
    restored on exit."""
    import hyperdryrun.engine as engine

    # the package root is loaded with this module (a layer above: its attribute is patched, nothing imported)
    package = sys.modules["hyperdryrun"]
    saved = [(m, m.__dict__.get("simulate")) for m in (package, engine)]
    for module, _ in saved:
        module.simulate = _capture  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, old in saved:
            if old is None:
                del module.simulate  # type: ignore[attr-defined]
            else:
                module.simulate = old  # type: ignore[attr-defined]


_LOADED: dict[str, LoadedScript] = {}


def _where(err: BaseException, path: str | None) -> str:
    """`` (train.py:12)``: the innermost frame of the error in the script's file (or in any file, without one)."""
    if (
        isinstance(err, SyntaxError) and err.filename
    ):  # the place is the error's own, not a frame's (importlib)
        return f" ({Path(err.filename).name}:{err.lineno})"
    frames = traceback.extract_tb(err.__traceback__)
    mine = [f for f in frames if path is not None and os.path.abspath(f.filename) == path] or frames[-1:]
    return f" ({Path(mine[-1].filename).name}:{mine[-1].lineno})" if mine else ""


def _split(spec: str) -> tuple[str | None, str | None, str | None]:
    """``(file, module, function)`` of a spec: ``train.py``, ``train.py:fn``, ``pkg.mod``, ``pkg.mod:fn``."""
    target, _, function = spec.rpartition(":") if ":" in spec else (spec, "", "")
    function = function or None
    if target.endswith(".py") or os.sep in target or (os.altsep and os.altsep in target):
        return target, None, function
    return None, target, function


def script_file(spec: str) -> str | None:
    """The Python file a spec names (None for a module: found on the path when loaded)."""
    return _split(spec)[0]


def load_script(spec: str) -> LoadedScript:
    """Execute the script of ``spec`` (once per process) with simulate() captured; its job function or its call.
    The file's directory (or, for a module, the working directory) goes first on ``sys.path``, as ``python FILE``
    and ``python -m`` put it."""
    if spec in _LOADED:
        return _LOADED[spec]
    if not spec.strip():
        raise ScriptError("script: give a Python file or module:function (got '')")
    path, module_name, function = _split(spec)
    label = spec
    captured: tuple | None = None
    module: Any = None
    with _simulate_captured():
        try:
            if path is not None:
                file = os.path.abspath(path)
                if not os.path.isfile(file):
                    raise ScriptError(f"script: no such file {path!r}")
                module = _exec_file(file)
            else:
                assert module_name is not None
                if "" not in sys.path and os.getcwd() not in sys.path:
                    sys.path.insert(0, os.getcwd())
                try:
                    module = importlib.import_module(module_name)
                except ModuleNotFoundError as err:
                    if err.name is not None and module_name.startswith(err.name):
                        raise ScriptError(f"script: no module named {err.name!r} (in {spec!r})") from None
                    raise
        except _Captured as call:
            captured = (call.call_args, call.call_kwargs)
        except ScriptError:
            raise
        except BaseException as err:
            if isinstance(err, KeyboardInterrupt | BrokenPipeError):  # 130; 141 for its prints into `| head`
                raise
            file = os.path.abspath(path) if path is not None else None
            raise ScriptError(
                f"script: running {spec!r} raised {type(err).__name__}: {err}{_where(err, file)}"
            ) from err
    loaded = LoadedScript(spec, label)
    if captured is not None and function is None:
        args, kwargs = captured
        names = ("model_fn", "batch_fn")
        if len(args) > len(names):
            raise ScriptError(
                f"script: {spec!r} calls simulate() with {len(args)} positional arguments (at most 2)"
            )
        loaded.captured = {**dict(zip(names, args, strict=False)), **kwargs}
    else:
        if captured is not None:
            raise ScriptError(
                f"script: {spec!r} calls hyperdryrun.simulate() while it is imported: move the call under "
                f"`if __name__ == '__main__':` to use its function {function!r}"
            )
        name = function or JOB_FUNCTION
        fn = getattr(module, name, None)
        if fn is None:
            hint = "" if function else " and calls no hyperdryrun.simulate() at its top level"
            raise ScriptError(f"script: {spec!r} has no function {name!r}{hint}")
        if not callable(fn):
            raise ScriptError(f"script: {spec!r}: {name!r} is a {type(fn).__name__}, not a function")
        loaded.function = fn
        layouts = getattr(module, LAYOUTS_FUNCTION, None)
        loaded.layouts_function = layouts if callable(layouts) else None
    _LOADED[spec] = loaded
    return loaded


def _exec_file(file: str) -> Any:
    """Run ``file`` as a module named after it (``__hyperdryrun_script__`` if that name is taken), registered in
    ``sys.modules`` so that its classes and dataclasses resolve their module."""
    stem = Path(file).stem
    name = stem if stem.isidentifier() and stem not in sys.modules else "__hyperdryrun_script__"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ScriptError(f"script: {file!r} cannot be loaded as Python source")
    module = importlib.util.module_from_spec(spec)
    directory = os.path.dirname(file)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


# ------------------------------------------------------------------------------------------------- the world
def script_identity(loaded: LoadedScript) -> dict[str, int | None]:
    """The world a script fixes itself (the ``world_size``/``rank``/``local_rank`` of its simulate() call)."""
    call = loaded.captured or {}
    return {key: call[key] for key in IDENTITY if call.get(key) is not None}


def resolve_identity(loaded: LoadedScript, given: Mapping[str, int | None]) -> dict[str, int | None]:
    """The launched rank: the command line or torchrun's variables (``given``), field by field over the script's
    own (world size 1 and rank 0 where neither says)."""
    own = script_identity(loaded)
    out: dict[str, int | None] = {"world_size": 1, "rank": 0, "local_rank": None}
    for key in IDENTITY:
        if given.get(key) is not None:
            out[key] = given[key]
        elif own.get(key) is not None:
            out[key] = own[key]
    for key in IDENTITY:
        value = out[key]
        if value is not None and (type(value) is not int or value < (1 if key == "world_size" else 0)):
            raise ScriptError(f"script: {loaded.label!r} gives simulate() {key}={value!r}")
    return out


@contextlib.contextmanager
def torchrun_environment(world_size: int, rank: int, local_rank: int) -> Iterator[None]:
    """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` as torchrun sets them for the launched rank; the environment is
    restored on exit."""
    saved = {var: os.environ.get(var) for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank)})
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


@contextlib.contextmanager
def script_argv(spec: str, argv: tuple[str, ...] | list[str] = ()) -> Iterator[None]:
    """``sys.argv`` as ``python FILE ARGS`` would give the script (its own arguments, after ``--`` on the command
    line), so that code parsing it at import or in the job function sees its own; restored on exit."""
    from hyperdryrun.compat.process import argv_patch
    from hyperdryrun.patches import PatchSet

    path, module, _ = _split(spec)
    with PatchSet([argv_patch([path if path is not None else str(module), *argv])]):
        yield


# ------------------------------------------------------------------------------------------------- the job
def _call(loaded: LoadedScript, fn: Callable[..., Any], what: str, *args: Any) -> Any:
    """``fn(*args)`` (or ``fn()`` when it takes no argument); anything it raises is a one-line ScriptError."""
    try:
        takes = len(inspect.signature(fn).parameters) > 0
    except (TypeError, ValueError):
        takes = True
    try:
        return fn(*args) if takes else fn()
    except (KeyboardInterrupt, BrokenPipeError):
        raise
    except SystemExit as err:
        raise ScriptError(
            f"script: {what} of {loaded.label!r} called sys.exit({err.code!r}): return the job instead"
        ) from err
    except Exception as err:
        file = inspect.getsourcefile(fn)
        raise ScriptError(
            f"script: {what} of {loaded.label!r} raised {type(err).__name__}: {err}"
            f"{_where(err, os.path.abspath(file) if file else None)}"
        ) from err


def job_arguments(loaded: LoadedScript, launch: Launch) -> dict[str, Any]:
    """The job's simulate() arguments for ``launch`` (validated: a dict of known keys, model_fn and batch_fn
    callable; identity keys of a job function agree with the launch); ``rank_class`` stays in it."""
    if loaded.captured is not None:
        job = dict(loaded.captured)
        job.pop("capture_stacks", None)  # the command line's --no-stacks decides
        for key in IDENTITY:
            job.pop(key, None)  # resolved into the launch
    else:
        assert loaded.function is not None
        name = getattr(loaded.function, "__name__", JOB_FUNCTION)
        job = _call(loaded, loaded.function, f"{name}(launch)", launch)
        if not isinstance(job, Mapping):
            raise ScriptError(
                f"script: {name}(launch) of {loaded.label!r} returned a {type(job).__name__}, not a dict of "
                "simulate()'s arguments"
            )
        job = dict(job)
        for key in IDENTITY:
            if key in job:
                want, got = getattr(launch, key), job.pop(key)
                if got != want:
                    raise ScriptError(
                        f"script: {name}(launch) of {loaded.label!r} returned {key}={got!r}, but the "
                        f"launch is {key}={want} (the world comes from --{key.replace('_', '-')} or torchrun's "
                        f"${key.upper()}: use launch.{key})"
                    )
    unknown = sorted(set(job) - {*PLAN_KEYS, *RUNTIME, RANK_CLASS})
    if unknown:
        raise ScriptError(
            f"script: {loaded.label!r} gives an unknown argument {unknown[0]!r} (simulate()'s are: "
            f"{', '.join((*PLAN_KEYS, *RUNTIME))}; and {RANK_CLASS})"
        )
    for key in ("model_fn", "batch_fn"):
        if not callable(job.get(key)):
            raise ScriptError(f"script: {loaded.label!r} gives no callable {key} (got {job.get(key)!r})")
    if (job.get("loss_fn") is None) == (job.get("step_fn") is None):
        raise ScriptError(f"script: {loaded.label!r} must give exactly one of loss_fn or step_fn")
    return job


def rank_class_of(loaded: LoadedScript, launch: Launch) -> Any:
    """The script's ``rank_class`` for ``launch`` (None: it declares none, so the rank is a class of its own)."""
    if loaded.captured is not None:
        return None
    return job_arguments(loaded, launch).get(RANK_CLASS)


def layouts_of(loaded: LoadedScript, world_size: int) -> list[dict[str, Any]]:
    """The layouts ``hyperdryrun_layouts(world_size)`` declares, in its order (each a dict of str to a number,
    string or bool); a script without the function is a one-line error."""
    if loaded.layouts_function is None:
        raise ScriptError(
            f"script: {loaded.label!r} declares no layouts: --fit needs a function "
            f"{LAYOUTS_FUNCTION}(world_size) -> list of dicts beside {JOB_FUNCTION}"
        )
    layouts = _call(loaded, loaded.layouts_function, f"{LAYOUTS_FUNCTION}(world_size)", world_size)
    if not isinstance(layouts, list | tuple) or not layouts:
        raise ScriptError(
            f"script: {LAYOUTS_FUNCTION}({world_size}) of {loaded.label!r} must return a non-empty list of dicts "
            f"(got {layouts!r})"
        )
    out = []
    for layout in layouts:
        ok = isinstance(layout, Mapping) and all(
            isinstance(k, str) and isinstance(v, int | float | str | bool) for k, v in layout.items()
        )
        if not ok:
            raise ScriptError(
                f"script: {LAYOUTS_FUNCTION}({world_size}) of {loaded.label!r}: each layout must be a dict of "
                f"names to numbers, strings or bools (got {layout!r})"
            )
        out.append(dict(layout))
    return out


@dataclass
class ScriptExecute:
    """How the runner runs a rank of a script's job: ``execute(cfg, capture_stacks=...) -> StepTrace`` (module
    level and picklable, so a worker process runs it too). ``cfg`` carries the launched rank, the target device and
    the CUDA runtime; the script and the layout travel here."""

    spec: str
    layout: dict[str, Any] = field(default_factory=dict)
    argv: tuple[str, ...] = ()
    """The script's own command-line arguments (its ``sys.argv[1:]``)."""
    routing: Any = None
    """The MoE routing option (:class:`~hyperdryrun.world.routing.RoutingSpec`, None: balanced): the
    ``moe.token_counts`` value rules active while the step runs, for the routed layers that ask for them
    (:mod:`hyperdryrun.parallel.expert`'s dispatch, Hugging Face experts under :func:`~hyperdryrun.parallel.hf.
    apply_hf_routing`); a script's own ``use_rules`` inside its step wins."""

    def __call__(self, cfg: Any, capture_stacks: bool = True) -> Any:
        from hyperdryrun.world.routing import RoutingSpec
        from hyperdryrun.world.values import ValueRules, use_rules

        world = cfg.world
        local_rank = world.rank if world.local_rank is None else world.local_rank
        rules = ValueRules((self.routing or RoutingSpec()).routing_rules())
        with (
            script_argv(self.spec, self.argv),
            torchrun_environment(world.world_size, world.rank, local_rank),
            use_rules(rules),
        ):
            return self._simulate(cfg, capture_stacks, local_rank)

    def _simulate(self, cfg: Any, capture_stacks: bool, local_rank: int) -> Any:
        from hyperdryrun.engine import SimulationError, job_plan, simulate_plan

        loaded = load_script(self.spec)
        world = cfg.world
        launch = Launch(world.world_size, world.rank, local_rank, dict(self.layout))
        job = job_arguments(loaded, launch)
        job.pop(RANK_CLASS, None)
        cuda = job.pop("cuda", None)
        target = job.pop("target_device", None)
        if target is not None and target != cfg.target_device:
            raise ScriptError(
                f"script: {loaded.label!r} gives target_device={target!r}, but the run's is {cfg.target_device!r}: "
                "the command line's --target-device (cuda or cpu) decides; drop it from the job or give the flag"
            )
        if cuda is not None and cfg.cuda == type(cfg.cuda)():
            runtime = cuda  # the script's, where the command line gave no --gpu / --alloc-conf
        else:
            runtime = cfg.cuda
        metadata = {**(job.pop("metadata", None) or {}), "script": self.job_metadata(cfg)["script"]}
        shape = tuple(job.get("mesh_shape") or (world.world_size,))
        names = tuple(job.get("mesh_dim_names") or (f"dim{i}" for i in range(len(shape))))
        metadata.setdefault("model", loaded.label)  # the report's headline names the script
        if self.routing is not None:
            metadata.setdefault("routing", self.routing.describe())
        metadata.setdefault("parallel", dict(zip(names, shape, strict=False)))
        model_fn, batch_fn = job.pop("model_fn"), job.pop("batch_fn")
        try:
            plan = job_plan(
                model_fn,
                batch_fn,
                **job,
                world_size=world.world_size,
                rank=world.rank,
                local_rank=world.local_rank,
                target_device=cfg.target_device,
                cuda=runtime,
                metadata=metadata,
            )
        except (TypeError, ValueError) as err:
            raise ScriptError(f"script: {loaded.label!r}: {err}") from err
        try:
            return simulate_plan(plan, capture_stacks=capture_stacks)
        except SimulationError as err:
            raise _users_own(err, loaded, (model_fn, batch_fn, *job.values())) from err.error

    def job_metadata(self, cfg: Any) -> dict[str, Any]:
        """What a report (an error report too) says about the job: the script, its mode, the layout."""
        from hyperdryrun.version import __version__

        loaded = _LOADED.get(self.spec)
        return {
            "mode": "dry-run",
            "hyperdryrun_version": __version__,
            "world_size": cfg.world.world_size,
            "rank": cfg.world.rank,
            "script": {
                "spec": self.spec,
                "mode": loaded.mode if loaded is not None else None,
                "layout": dict(self.layout),
            },
            **({"routing": self.routing.describe()} if self.routing is not None else {}),
        }


def _users_own(err: Any, loaded: LoadedScript, callbacks: tuple[Any, ...]) -> Any:
    """``err`` (a :class:`~hyperdryrun.engine.SimulationError`) as bad input when the user's own code raised it:
    the innermost frame of its traceback is in a file of the job's callbacks (``raise ValueError`` in ``loss_fn``,
    a RecursionError of its own). An error raised inside torch (a fake tensor's limit, an operator's check) or the
    dry run is left as it was: it may be the dry run's."""
    from hyperdryrun.engine import SimulationError

    cause = err.error
    if isinstance(cause, ConfigError) or cause.__traceback__ is None:
        return err
    files = set()
    for fn in callbacks:
        if callable(fn):
            with contextlib.suppress(TypeError, OSError):
                source = inspect.getsourcefile(inspect.unwrap(fn))
                if source:
                    files.add(os.path.abspath(source))
    last = traceback.extract_tb(cause.__traceback__)[-1]
    if os.path.abspath(last.filename) not in files:
        return err
    where = f"{Path(last.filename).name}:{last.lineno}"
    return SimulationError(
        err.stage,
        ScriptError(
            f"script: {last.name}() of {loaded.label!r} raised {type(cause).__name__}: {cause} ({where})"
        ),
    )
