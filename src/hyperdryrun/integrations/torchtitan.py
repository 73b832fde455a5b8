"""torchtitan jobs as they are: its config, model, parallelize function, activation checkpointing, optimizer
container, loss and train step for rank ``r`` of ``N``, on fake tensors (tested: torchtitan 0.3.0, torch 2.13.0).

What runs is torchtitan's own code: ``ConfigManager`` parses ``--module``/``--config`` and the overrides as
``torchtitan.train`` does; the model is built from the model spec on meta; ``ParallelDims`` builds torchtitan's
meshes over the simulated world; the spec's ``parallelize_fn`` applies TP, activation checkpointing, compile and
FSDP (under pipeline parallel, its ``pipelining_fn`` cuts rank ``r``'s stages, parallelizes each and builds the
schedule, whose stages get static shapes as the built-in recipe's do); the ``OptimizersContainer``,
``LRSchedulersContainer`` and loss (``ChunkedLossWrapper`` included) are built from the config; the step is
``Trainer.train_step`` itself, run on a trainer holding those parts. What does not run: the data loader (micro
batches of the configured shape are made on the device), the tokenizer, the checkpointer, metrics, validation and
profiling.

>>> trace = simulate_torchtitan(
...     ["--module", "llama3", "--config", "llama3_8b", "--parallelism.data_parallel_shard_degree", "8"],
...     world_size=8, rank=0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Required, TypedDict, Unpack

import torch
from torch import nn

from hyperdryrun.compat import torch_fsdp
from hyperdryrun.compat import torchtitan as titan_compat
from hyperdryrun.compat import torchtitan_families as families
from hyperdryrun.compat.torchtitan import TESTED_VERSION, torchtitan_version
from hyperdryrun.compat.versions import torch_version
from hyperdryrun.config import ConfigError
from hyperdryrun.patches import Patch, PatchSet

SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""torch.distributed.pipelining schedules that run a stage's backward in two parts (input gradients, then weights)."""

SPMD_BACKEND_FLAGS = ("--parallelism.spmd_backend", "--parallelism.spmd-backend")


class TorchtitanError(ConfigError):
    """A torchtitan job the dry run cannot run as given; the message is one line naming the field (bad input, as
    a :class:`~hyperdryrun.config.ConfigError`, also for the runner's workers)."""


def load_config(argv: Sequence[str], gpu: str | None = None) -> Any:
    """torchtitan's ``Trainer.Config`` from its own command line (``--module``, ``--config``, overrides); the GPU
    checks of its quantization converters (float8, MXFP8, NVFP4) answer as ``gpu`` (a preset; default: the
    default CUDA target's), :func:`hyperdryrun.compat.torchao.capability_patches`."""
    from hyperdryrun.compat import torchao as ao_compat
    from hyperdryrun.world.gpus import DEFAULT_GPU, gpu_preset

    try:
        with ao_compat.quiet_import():
            from torchtitan.config import ConfigManager
    except ImportError as err:
        raise TorchtitanError(
            f"torchtitan is not importable ({err}); install the extra: pip install 'hyperdryrun[torchtitan]'"
        ) from None
    from torchtitan.tools.logging import logger as titan_logger

    preset = gpu_preset(gpu or DEFAULT_GPU)
    ao_compat.import_quantization_modules()
    level = titan_logger.level  # torchtitan logs to the root logger; its warnings speak of a real run
    titan_logger.setLevel(logging.ERROR)
    printed = io.StringIO()
    try:
        _import_registry(argv)
        with (
            contextlib.redirect_stderr(printed),
            PatchSet(ao_compat.capability_patches(preset.compute_capability)),
        ):
            return ConfigManager().parse_args(list(argv))
    except SystemExit as err:  # tyro printed why, in a box
        if err.code == 0:  # torchtitan's --help, printed
            raise
        why = _tyro_message(printed.getvalue()) or f"exit {err.code}"
        raise TorchtitanError(f"torchtitan rejected the arguments {' '.join(argv)!r}: {why}") from None
    except (ValueError, ImportError, AttributeError) as err:
        missing = _missing_dependency(argv) if isinstance(err, ImportError) else None
        where = ao_compat.refused_on(err, preset.name, preset.compute_capability)
        raise TorchtitanError(f"--module/--config: {where}{missing or err}") from None
    finally:
        titan_logger.setLevel(level)


def _module_name(argv: Sequence[str]) -> str | None:
    """The ``--module`` of torchtitan's command line, when it is a plain name."""
    names = [a.split("=", 1)[1] for a in argv if a.startswith("--module=")]
    names += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--module"]
    if not names or not names[-1].replace("_", "").isalnum():
        return None
    return names[-1]


def _import_registry(argv: Sequence[str]) -> None:
    """Import the ``--module``'s config registry before torchtitan's ConfigManager does; where it stops at the
    missing torchvision (qwen3_5, kimi_k2_7: the multimodal data loader), again with torchvision stood in for
    (:func:`hyperdryrun.compat.torchtitan_families.torchvision_stand_in`). Other failures: ConfigManager's."""
    import importlib

    module = _module_name(argv)
    if module is None:
        return
    registry = f"torchtitan.models.{module}.config_registry"
    with (
        warnings.catch_warnings()
    ):  # fla on import: "Triton is not supported on current platform" (no GPU here)
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
        try:
            importlib.import_module(registry)
        except ModuleNotFoundError as err:
            if err.name == "torchvision":
                with contextlib.suppress(Exception), families.torchvision_stand_in():
                    importlib.import_module(registry)
        except Exception:  # noqa: BLE001  (ConfigManager imports it again and says why)
            return


def _missing_dependency(argv: Sequence[str]) -> str | None:
    """Why torchtitan's ``--module`` config registry did not import, when a package it needs is not installed:
    torchtitan 0.3.0's ConfigManager swallows the ImportError ("Cannot import config_registry for module ...").
    E.g. qwen3_5 needs ``fla`` (flash-linear-attention, Triton kernels)."""
    import importlib

    module = _module_name(argv)
    if module is None:
        return None
    try:
        with families.torchvision_stand_in():
            importlib.import_module(f"torchtitan.models.{module}.config_registry")
    except ModuleNotFoundError as err:
        if err.name and not err.name.startswith("torchtitan"):
            return f"torchtitan's {module!r} models import {err.name!r}, which is not installed (got --module {module})"
    except Exception:  # noqa: BLE001  (any other failure: torchtitan's own message stands)
        return None
    return None


def _tyro_message(text: str) -> str:
    """The message inside tyro's error box (up to its first rule), as one line."""
    lines = []
    for raw in text.splitlines()[1:]:
        line = raw.strip().strip("│").strip()
        if line.startswith(("─", "╰")):
            break
        lines.append(line)
    return " ".join(" ".join(lines).split())


def _spmd_types_fsdp_supported() -> bool:
    """Whether this torch's ``fully_shard`` takes spmd_types-annotated parameters
    (:func:`hyperdryrun.compat.torch_fsdp.spmd_types_supported`)."""
    return torch_fsdp.spmd_types_supported()


def _flag_given(argv: Sequence[str], names: Sequence[str]) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def _device_patches(simulation_device: str) -> list[Patch]:
    """torchtitan's device type follows the simulation device (:func:`hyperdryrun.compat.torchtitan.device_patches`)."""
    return titan_compat.device_patches(simulation_device)


def _titan_patches(real: bool = False) -> list[Patch]:
    """What torchtitan needs on fake tensors (:func:`hyperdryrun.compat.torchtitan.fake_tensor_patches`)."""
    return titan_compat.fake_tensor_patches(real)


def _routing_patches() -> list[Patch]:
    """torchtitan's expert-parallel all-to-all split sizes from the routing rule (``moe.token_counts``: balanced
    unless given), every EP rank routing its tokens alike (:func:`hyperdryrun.compat.torchtitan.routing_patches`)."""
    from hyperdryrun.world.values import _current_module, active_rules

    def token_counts() -> Any:
        rules = active_rules()
        if rules is None:
            return None
        return lambda tokens, experts, top_k: rules.token_counts(_current_module(), tokens, experts, top_k)

    return titan_compat.routing_patches(token_counts)


@contextlib.contextmanager
def _restored_torchtitan_globals() -> Iterator[None]:
    """torchtitan sets process globals while it builds a job (the SPMD backend, dynamo and Inductor configs in
    apply_compile), and logs to the root logger: all restored on exit."""
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config
    import torch.distributed._symmetric_memory as symm_mem
    import torchtitan.distributed.utils as titan_dist
    from torchtitan.tools.logging import logger as titan_logger

    configs = [torch._dynamo.config, torch._functorch.config, torch._inductor.config]
    saved = [c.get_config_copy() for c in configs]
    symm_stores = dict(symm_mem._group_name_to_store)  # async TP enables symmetric memory for the tp group
    backend = titan_dist.get_spmd_backend()
    level = titan_logger.level  # torchtitan logs to the root logger
    titan_logger.setLevel(logging.ERROR)  # its INFO/WARNING lines speak of a real run ("HF assets path ...")
    try:
        yield
    finally:
        titan_logger.setLevel(level)
        titan_dist.set_spmd_backend(backend)
        symm_mem._group_name_to_store.clear()
        symm_mem._group_name_to_store.update(symm_stores)
        for config, values in zip(configs, saved):
            now = config.get_config_copy()
            for key, value in values.items():
                if now.get(key) is not value and now.get(key) != value:
                    setattr(config, key, value)


class _NoMetrics:
    """Stands in for torchtitan's MetricsProcessor: the step never logs (no loss ``.item()``, no reductions)."""

    ntokens_since_last_log = 0

    def should_log(self, step: int) -> bool:
        return False


class _NoCheckpointer:
    """Stands in for torchtitan's checkpointer: nothing is staged or saved."""

    def maybe_wait_for_staging(self) -> None:
        return None


@dataclasses.dataclass
class TorchtitanJob:
    """One torchtitan job on rank ``rank`` of ``world_size``: the parsed config and what the simulation builds."""

    argv: list[str]
    world_size: int
    rank: int = 0
    local_rank: int | None = None
    n_layers: int | None = None
    target_device: str = "cuda"
    attention: str | None = None
    """``"sdpa"``: every layer's inner attention becomes torchtitan's ScaledDotProductAttention (None: as configured)."""
    real: bool = False
    """Executed for real (``measure``): no value rules, parameters initialised by torchtitan itself."""
    routing: dict[str, list[int]] | None = None
    """MoE routing of the dry run: per-expert token counts by routed-experts module FQN (e.g. a measured run's,
    :func:`measured_routing`); modules not named route balanced."""
    gpu: str | None = None
    """The target GPU preset (:mod:`hyperdryrun.world.gpus`): its kernels, and the answer to the GPU checks of
    torchtitan's float8/MX converters; None: the default CUDA target's, with no capacity."""
    config: Any = None
    limitations: list[str] = dataclasses.field(default_factory=list)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    model: Any = None
    parallel_dims: Any = None
    loss_fn: Any = None
    lr_schedulers: Any = None
    gradient_accumulation_steps: int = 1
    pp_microbatches: int = 1
    """Micro batches of the pipeline schedule (torchtitan's ``num_pipeline_parallel_microbatches``; 1 without pp)."""
    model_parts: list[nn.Module] = dataclasses.field(default_factory=list)
    pp_schedule: Any = None
    pp_has_first_stage: bool = True
    pp_has_last_stage: bool = True

    # ------------------------------------------------------------------ config
    def prepare(self) -> None:
        """Parse and check the config; everything here is torchtitan's own config handling."""
        self.config = config = load_config(self.argv, self.gpu)
        from torchtitan.distributed import ParallelDims

        p, t = config.parallelism, config.training
        if t.enable_cpu_offload:
            raise TorchtitanError(
                "training.enable_cpu_offload (--training.enable_cpu_offload): FSDP CPU offload is not supported by "
                "the dry run (got True)"
            )
        if (
            p.spmd_backend == "spmd_types"
            and p.data_parallel_replicate_degree
            * self._dp_shard()
            * p.context_parallel_degree
            * p.tensor_parallel_degree
            > 1
            and not _spmd_types_fsdp_supported()
        ):
            why = (
                f"parallelism.spmd_backend='spmd_types' shards parameters through fully_shard support for "
                f"spmd_types annotations (pytorch/pytorch#181519) that torch {torch_version()} lacks"
            )
            if families.dist_muon_groups(config):
                raise TorchtitanError(
                    "--optimizer: this config optimizes with torchtitan's DistMuon, whose compute layouts name "
                    f"the 'dp_shard' mesh axis that only spmd_types builds, and {why}; with partial_dtensor "
                    "DistMuon refuses FSDP's mesh "
                    "(\"declares no axis in storage mesh ['fsdp']\"), also on GPUs; on one rank (--world-size 1) it "
                    "runs"
                )
            if _flag_given(self.argv, SPMD_BACKEND_FLAGS):
                raise TorchtitanError(
                    f"parallelism.spmd_backend (--parallelism.spmd_backend): {why}; use partial_dtensor"
                )
            p.spmd_backend = "partial_dtensor"
            self.limitations.append(
                f"torchtitan 0.3.0's default {why}, so it fails on this torch also on GPUs: the job ran with "
                "parallelism.spmd_backend='partial_dtensor' (the same FSDP2/TP layout as DTensors)"
            )
        try:
            dims = ParallelDims.from_config(p, self.world_size)
        except AssertionError as err:
            raise TorchtitanError(
                f"parallelism (--parallelism.*): {err} (world size {self.world_size})"
            ) from None
        divisor = (dims.tp if p.enable_sequence_parallel else 1) * (2 * dims.cp if dims.cp > 1 else 1)
        if t.seq_len % divisor:
            raise TorchtitanError(
                f"training.seq_len (--training.seq_len): must be divisible by {divisor} for the configured "
                f"sequence/context parallelism (got {t.seq_len})"
            )
        batch_degree = dims.dp_replicate * dims.dp_shard
        global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * batch_degree
        if global_batch % (t.local_batch_size * batch_degree):
            raise TorchtitanError(
                f"training.global_batch_size (--training.global_batch_size): must be a multiple of local batch "
                f"size x data-parallel degree = {t.local_batch_size} x {batch_degree} (got {global_batch})"
            )
        self.gradient_accumulation_steps = global_batch // (t.local_batch_size * batch_degree)
        if dims.pp_enabled:
            self._check_pipeline(dims)
            self._pipeline_limitations()
            self.pp_microbatches = t.local_batch_size // p.pipeline_parallel_microbatch_size

        model_config = config.model_spec.model
        model_config.update_from_config(config=config)
        if config.override.imports:
            from torchtitan.config.override import apply_overrides

            apply_overrides(config.override, config)
        layers = len(model_config.layers)
        if self.n_layers is not None:
            if not 1 <= self.n_layers <= layers:
                raise TorchtitanError(
                    f"--n-layers: must be between 1 and the model's {layers} (got {self.n_layers})"
                )
            model_config.layers = model_config.layers[: self.n_layers]
            self.limitations.append(
                f"the model is cut to its first {self.n_layers} of {layers} layers (--n-layers)"
            )
        if self.attention is not None:
            self._use_attention(model_config)
        self._moe_limitations(dims, model_config)
        if families.fla_layers(model_config) and not self.real:
            self.limitations.append(
                f"Gated DeltaNet layers {families.fla_layers(model_config)}: fla's Triton kernels "
                f"({families.FLA_KERNEL}) are not run; their memory is the outputs and intermediates fla allocates "
                "with torch (sized as on an H100, H200 or B200: 232,448 B of shared memory per block; on an A100 "
                "one gradient buffer may be sized differently); Triton's autotuning copies on a "
                "first step are not counted"
            )
        if config.compile.enable_async_tensor_parallel and dims.tp_enabled:
            self.limitations.append(
                "compile.enable_async_tensor_parallel: async TP is Inductor's micro-pipeline pass over compiled "
                "regions, which run eagerly in the dry run: TP collectives run unfused and async TP's symmetric-"
                "memory buffers are not counted"
            )
        if not t.disable_cuda_graphs:
            self.limitations.append(
                "training.disable_cuda_graphs=False: on a CUDA GPU torchtitan captures forward+backward in a CUDA "
                "graph (its private pool keeps the region's memory reserved across steps); the dry run runs it "
                "eagerly and counts allocated bytes"
            )
        if config.debug.deterministic:
            self.limitations.append(
                "debug.deterministic is not applied (torch's deterministic algorithms stay off)"
            )
        self.limitations.append(
            f"torchtitan's data loader, tokenizer, checkpointer, metrics, validator and profiler do not run: each "
            f"micro batch is {self._micro_batch_size()} x {t.seq_len} input tokens, positions (one document per "
            "row) and labels made on the device"
        )
        self._fill_metadata(dims, layers)

    def _check_pipeline(self, dims: Any) -> None:
        """What the dry run runs of torchtitan's pipelining: its ``pipelining_fn`` with a schedule of
        torch.distributed.pipelining, alone or with FSDP/HSDP; the rest is one line naming the field."""
        from torchtitan.distributed.activation_checkpoint import SelectiveAC

        from hyperdryrun.parallel.dims import PIPELINE_SCHEDULES

        p = self.config.parallelism
        refused = [
            (
                p.pipeline_parallel_schedule not in PIPELINE_SCHEDULES,
                "--parallelism.pipeline_parallel_schedule",
                f"must be one of {', '.join(PIPELINE_SCHEDULES)}",
            ),
        ]
        csv = p.pipeline_parallel_schedule_csv
        if csv and not os.path.isfile(csv):  # torchtitan's FileNotFoundError, one line before any work
            raise TorchtitanError(
                "parallelism.pipeline_parallel_schedule_csv (--parallelism.pipeline_parallel_schedule_csv): "
                f"no such file (got {csv!r})"
            )
        split = p.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES
        if split and isinstance(self.config.activation_checkpoint, SelectiveAC.Config):
            raise TorchtitanError(
                "activation_checkpoint (activation-checkpoint:selective): torch's selective activation checkpointing "
                f"allows one backward per region and {p.pipeline_parallel_schedule} runs two (inputs, then weights), "
                "so the job fails also on GPUs; use activation-checkpoint:full or none (got SelectiveAC)"
            )
        for bad, flag, why in refused:
            if bad:
                field = flag.removeprefix("--")
                value = getattr(p, field.split(".")[1], dims.pp)
                raise TorchtitanError(f"{field} ({flag}): {why} in the dry run (got {value!r})")

    def _pipeline_limitations(self) -> None:
        """What the pipeline step differs in from a run of torchtitan 0.3.0 on this torch (stated in the report)."""
        from torch.distributed.pipelining.schedules import get_schedule_class

        self.limitations.append(
            "pipeline: only this rank's stages were run; point-to-point sends and receives complete at once on the "
            "fake process group, so a send buffer is freed when the schedule drops it (on CUDA, NCCL's stream may "
            "hold it a little longer)"
        )
        cls = get_schedule_class(self.config.parallelism.pipeline_parallel_schedule)
        if not _takes_micro_batches(cls):
            self.limitations.append(
                f"torchtitan {TESTED_VERSION}'s pipeline train step calls the schedule's step with pre-split micro "
                f"batches (arg_mbs=, kwarg_mbs=, target_mbs=), which torch {torch_version()} lacks, so the job fails "
                "on this torch also on GPUs: the dry run gave them to the schedule's _step_microbatches as they are"
            )

    def _moe_limitations(self, dims: Any, model_config: Any) -> None:
        """What the routing of a MoE model's dry run is (stated in the report): on a GPU only expert parallelism's
        all-to-all and the tensors it sizes depend on it; without EP every routed tensor has tokens x top_k rows."""
        moe = [layer.moe for layer in model_config.layers if getattr(layer, "moe", None) is not None]
        if not moe or self.real or dims.ep == 1:
            return
        given = sorted(self.routing or {})
        how = (
            f"the given per-expert counts for {', '.join(given)} (routing=), balanced for any other"
            if given
            else "balanced (every expert gets tokens x top_k / experts; measure_torchtitan records a step's real "
            "counts, measured_routing passes them)"
        )
        self.limitations.append(
            f"MoE routing: the expert-parallel all-to-all's split sizes and the grouped GEMMs' rows come from the "
            f"routing rule (moe.token_counts): {how}; every EP rank routes its tokens alike"
        )

    def _use_attention(self, model_config: Any) -> None:
        """Every layer's inner attention as ``--attention`` asks (only ``sdpa``: torchtitan's maskless
        ScaledDotProductAttention, ``is_causal``), e.g. to run a step on the CPU, where FlexAttention has no
        backward (torch 2.13)."""
        from torchtitan.models.common.attention import ScaledDotProductAttention

        if self.attention != "sdpa":
            raise TorchtitanError(f"--attention: must be 'sdpa' (got {self.attention!r})")
        replaced, sinks = set(), False
        for layer in model_config.layers:
            attention = getattr(layer, "attention", None)
            inner = getattr(attention, "inner_attention", None)
            if inner is not None and not isinstance(inner, ScaledDotProductAttention.Config):
                replaced.add(type(inner).__qualname__.removesuffix(".Config"))
                attention.inner_attention = ScaledDotProductAttention.Config()
                sinks |= type(attention).__module__.startswith("torchtitan.models.gpt_oss")
        if sinks:
            self.limitations.append(
                "--attention sdpa: gpt_oss's attention sinks and sliding windows are not applied (torchtitan's "
                "ScaledDotProductAttention takes the sink rescale, out_transform, and ignores it): the sinks get no "
                "gradient, and the rescale's activations are not counted"
            )
        if replaced:
            self.limitations.append(
                f"--attention sdpa: torchtitan's {', '.join(sorted(replaced))} replaced by its "
                "ScaledDotProductAttention (is_causal, no mask); for these synthetic batches (one document per row) "
                "the block-causal mask it would build is the causal one, so the attention computed is the same, "
                "but the kernels and their memory are SDPA's"
            )

    def _dp_shard(self) -> int:
        p = self.config.parallelism
        if p.data_parallel_shard_degree > 0:
            return p.data_parallel_shard_degree
        rest = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
        return max(1, self.world_size // (rest * p.pipeline_parallel_degree))

    def _fill_metadata(self, dims: Any, layers: int) -> None:
        config = self.config
        spec, model_config, t = config.model_spec, config.model_spec.model, config.training
        attention = model_config.first_attention
        inner = type(getattr(attention, "inner_attention", None)).__qualname__.removesuffix(".Config")
        ac = config.activation_checkpoint
        ac_mode = "none" if ac is None else type(ac).__qualname__.removesuffix(".Config")
        from hyperdryrun.version import __version__ as hyperdryrun_version

        batch = self._micro_batch_size()
        self.metadata.update(
            {
                "model": f"torchtitan {spec.name} {spec.flavor}",
                "parallel": {
                    "dp_replicate": dims.dp_replicate,
                    "dp_shard": dims.dp_shard,
                    "cp": dims.cp,
                    "tp": dims.tp,
                    "pp": dims.pp,
                    "ep": dims.ep,
                },
                "torchtitan": {
                    "version": torchtitan_version(),
                    "argv": list(self.argv),
                    "flavor": spec.flavor,
                    "dim": model_config.dim,
                    "n_layers": len(model_config.layers),
                    "n_layers_of_model": layers,
                    "vocab_size": model_config.vocab_size,
                    "attention": inner,
                    "activation_checkpoint": "none"
                    if ac is None
                    else type(ac).__qualname__.removesuffix(".Config"),
                    "loss": type(config.loss).__qualname__.removesuffix(".Config"),
                    "optimizer_implementation": config.optimizer.implementation,
                    "dtype": t.dtype,
                    "mixed_precision_param": t.mixed_precision_param,
                    "mixed_precision_reduce": t.mixed_precision_reduce,
                    "local_batch_size": t.local_batch_size,
                    "seq_len": t.seq_len,
                    "gradient_accumulation_steps": self.gradient_accumulation_steps,
                    "spmd_backend": config.parallelism.spmd_backend,
                    "compile": config.compile.enable,
                    "cuda_graphs": not t.disable_cuda_graphs,
                },
                "mode": "dry-run",
                "hyperdryrun_version": hyperdryrun_version,
                "torch_version": torch_version(),
                "dtype": t.dtype,
                "mixed_precision": {
                    "param_dtype": t.mixed_precision_param,
                    "reduce_dtype": t.mixed_precision_reduce,
                },
                "batch_shapes": {name: [batch, t.seq_len] for name in ("tokens", "positions", "labels")},
                "tokens_per_micro_batch": batch * t.seq_len,
                "tokens_per_step": t.local_batch_size * t.seq_len * self.gradient_accumulation_steps,
                "seq_len": t.seq_len,
                "micro_batch_size": batch,
                "activation_checkpointing": {"mode": ac_mode},
                "pipeline": self._pipeline_metadata(dims),
            }
        )

    def _micro_batch_size(self) -> int:
        """Rows of one micro batch: torchtitan's data loader yields pipeline micro batches under pp."""
        p = self.config.parallelism
        return (
            p.pipeline_parallel_microbatch_size
            if p.pipeline_parallel_degree > 1
            else self.config.training.local_batch_size
        )

    def _pipeline_metadata(self, dims: Any) -> dict[str, Any] | None:
        """This rank's place in the pipeline; the stages are filled in when torchtitan's pipelining_fn has run."""
        if not dims.pp_enabled:
            return None
        return {
            "schedule": self.config.parallelism.pipeline_parallel_schedule,
            # torchtitan runs a schedule CSV with torch's _PipelineScheduleRuntime (its _load_csv lowers the
            # compute actions to sends and receives); the schedule above still sets the stages per rank
            "schedule_csv": self.config.parallelism.pipeline_parallel_schedule_csv or None,
            "num_micro_batches": self.pp_microbatches,
            "fsdp_reshard_after_forward": self.config.parallelism.fsdp_reshard_after_forward,
        }

    # ------------------------------------------------------------------ what simulate calls
    def build_model(self) -> nn.Module:
        """The model on meta, in the configured dtype (torchtitan's trainer, without its checkpoint path)."""
        from torchtitan.config import TORCH_DTYPE_MAP
        from torchtitan.tools import utils

        model_config = self.config.model_spec.model
        with utils.set_default_dtype(TORCH_DTYPE_MAP[self.config.training.dtype]):
            model = model_config.build()
        model.verify_module_protocol()
        nparams, _ = model_config.get_nparams_and_flops(model, self.config.training.seq_len)
        self.metadata["torchtitan"]["parameters"] = self.metadata["num_params"] = nparams
        return model

    def parallelize(self, model: nn.Module, mesh: Any) -> nn.Module:
        """torchtitan's ParallelDims over the simulated world, its loss, then the model spec's parallelize function
        (under pp: its pipelining function, which cuts this rank's stages and parallelizes each)."""
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils

        config = self.config
        self.parallel_dims = dims = ParallelDims.from_config(config.parallelism, self.world_size)
        dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
        self.loss_fn = config.loss.build(compile_config=config.compile)
        if dims.pp_enabled:
            model = self._pipeline(model)
        else:
            model = config.model_spec.parallelize_fn(model, **self._spec_keywords())
            self.model = model
            self.model_parts = [model]
        self._quantization_metadata()
        return model

    def _quantization_metadata(self) -> None:
        """The float8/MX modules of this rank's model parts (torchtitan's quantization converters), in the metadata
        and, where compile runs eagerly, what that means for their casts (stated in the report)."""
        from hyperdryrun.compat.torchao import quantized_modules, torchao_version, untested

        counts = quantized_modules(self.model_parts)
        self.metadata["torchtitan"]["quantization"] = counts
        if not counts:
            return
        self.metadata["torchtitan"]["torchao_version"] = torchao_version()
        if line := untested(torchao_version()):
            self.limitations.append(line)
        self.limitations.append(
            f"float8/MX training ({', '.join(f'{n} {c}' for c, n in counts.items())}): torchao's casts run eagerly, "
            "as on a GPU without torch.compile: each cast's high-precision temporaries (abs, the scaled and clamped "
            "copies) are counted, which Inductor fuses into the fp8 output under compile"
        )

    def _spec_keywords(self) -> dict[str, Any]:
        """What torchtitan's Trainer passes to both the model spec's parallelize and pipelining functions."""
        config = self.config
        return {
            "parallel_dims": self.parallel_dims,
            "training": config.training,
            "parallelism": config.parallelism,
            "compile_config": config.compile,
            "ac_config": config.activation_checkpoint,
            "dump_folder": config.dump_folder,
        }

    def _pipeline(self, model: nn.Module) -> nn.Module:
        """torchtitan's ``pipelining_fn`` as its Trainer calls it; this rank's stage(s) are the model tracked."""
        from hyperdryrun.parallel.pipeline import PipelineStages

        config = self.config
        with PatchSet([self._stage_patch()]):
            schedule, parts, first, last = config.model_spec.pipelining_fn(
                model,
                **self._spec_keywords(),
                device=self._device(),
                model_config=config.model_spec.model,
                parallelize_fn=config.model_spec.parallelize_fn,
                loss_fn=self.loss_fn,
            )
        self.pp_schedule, self.model_parts = schedule, list(parts)
        self.pp_has_first_stage, self.pp_has_last_stage = first, last
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        ids = [stage.stage_index for stage in stages]
        self.metadata["pipeline"].update(
            {
                "pp_rank": self.parallel_dims.get_mesh("pp").get_local_rank(),
                "num_stages": stages[0].num_stages,
                "stage_indices": ids,
                "has_embedding": first,
                "has_head": last,
            }
        )
        self.model = (
            parts[0] if len(parts) == 1 else PipelineStages({f"stage{i}": m for i, m in zip(ids, parts)})
        )
        return self.model

    def _device(self) -> torch.device:
        """The stages' device: torchtitan's Trainer device, its device type as the simulated world has it."""
        from torchtitan.tools import utils

        return torch.device(utils.device_type)

    def _stage_patch(self) -> Patch:
        """torchtitan's pipeline split builds each ``PipelineStage`` with no example shapes; the built-in recipe's
        tracked stage with static shapes stands in for it."""
        import torchtitan.distributed.pipeline_parallel as titan_pp
        from torchtitan.components.loss import ChunkedLossWrapper
        from torchtitan.config import TORCH_DTYPE_MAP

        from hyperdryrun.parallel.pipeline import StageShapes, tracked_stage

        config, model_config = self.config, self.config.model_spec.model
        t, dims = config.training, self.parallel_dims
        # with the chunked loss, the last stage returns the normed hidden states (its loss runs the head)
        head = not isinstance(self.loss_fn, ChunkedLossWrapper)
        tp = self._tp_stage_placements(head) if dims.tp_enabled else {}

        def stage(part: nn.Module, index: int, num_stages: int, device: torch.device, **kw: Any) -> Any:
            mb = config.parallelism.pipeline_parallel_microbatch_size
            dtype = TORCH_DTYPE_MAP[t.mixed_precision_param]  # torchtitan always installs FSDP2's policy
            shapes = StageShapes(
                mb,
                t.seq_len,
                model_config.dim,
                model_config.vocab_size,
                dtype,
                num_stages,
                head=head,
                cp=dims.cp,
                **tp,
            )
            built = tracked_stage(part, index, device, kw.pop("group"), shapes, **kw)
            built._runtime_validate = True  # a wrong static shape is an error, not a wrong peak
            return built

        return titan_compat.pipeline_stage_patch(titan_pp, stage)

    def _tp_stage_placements(self, head: bool) -> dict[str, Any]:
        """What flows between stages under torchtitan's TP (``partial_dtensor``): the hidden state stays a DTensor
        on the tp mesh, sequence-sharded (``Shard(1)``) with sequence parallel, else replicated; the last stage
        returns vocab-sharded logits (``Shard(2)``, its loss-parallel cross entropy), or with the chunked loss
        the normed hidden state the root norm all-gathers (``Replicate()``)."""
        from torch.distributed.tensor import Replicate, Shard

        sp = self.config.parallelism.enable_sequence_parallel
        return {
            "mesh": self.parallel_dims.get_mesh("tp"),
            "hidden_placements": (Shard(1),) if sp else (Replicate(),),
            "output_placements": (Shard(2),) if head else (Replicate(),),
        }

    def build_optimizers(self, params: list[nn.Parameter]) -> Any:
        """After ``to_empty``: torchtitan's buffer initialisation, loss, optimizer and LR-scheduler containers."""
        from torchtitan.components.loss import ChunkedLossWrapper

        config, parts = self.config, self.model_parts
        for part in parts:
            with torch.no_grad():
                part.init_weights(buffer_device=None)
            part.train()
        if isinstance(self.loss_fn, ChunkedLossWrapper) and self.pp_has_last_stage:
            self.loss_fn.set_lm_head(parts[-1].lm_head)
            parts[-1]._skip_lm_head = True
        optimizers = config.optimizer.build(model_parts=parts)
        if config.model_spec.post_optimizer_build_fn is not None:
            config.model_spec.post_optimizer_build_fn(optimizers, parts, self.parallel_dims)
        self.lr_schedulers = config.lr_scheduler.build(
            optimizers=optimizers, training_steps=config.training.steps
        )
        self._steady_state_zero_grad(optimizers)
        return optimizers

    def _steady_state_zero_grad(self, optimizers: Any) -> None:
        """The warm-up step that precedes the traced one ends as torchtitan's step 1 does: train_step starts with
        ``zero_grad(set_to_none=training.disable_cuda_graphs)``, so with CUDA graphs on (the default) gradients
        are zeroed in place and step 2 starts with them allocated. Every call (the dry run's and the measured
        run's set-up included) uses torchtitan's ``set_to_none``, the only value its train_step passes."""
        set_to_none = self.config.training.disable_cuda_graphs

        def zero_grad(**_: Any) -> None:
            type(optimizers).zero_grad(optimizers, set_to_none=set_to_none)

        optimizers.zero_grad = zero_grad

    def make_batch(self, i: int, device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Micro batch ``i`` as torchtitan's text data loader yields it: input tokens, positions, labels (and, for
        a multimodal tokenizer, the fields its collator adds to a batch without images)."""
        t = self.config.training
        vocab = self.config.model_spec.model.vocab_size
        shape = (self._micro_batch_size(), t.seq_len)
        tokens = torch.randint(0, vocab, shape, device=device)
        positions = torch.arange(t.seq_len, device=device).repeat(shape[0], 1)
        labels = torch.randint(0, vocab, shape, device=device)
        return {
            "input": tokens,
            "positions": positions,
            **families.multimodal_batch_fields(self.config),
        }, labels

    def step(self, model: nn.Module, optimizers: Any, batches: Iterator[Any]) -> None:
        """``Trainer.train_step`` on a trainer that holds this job's parts (no metrics, no checkpointer)."""
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.distributed.cudagraph import wrap_with_cuda_graph
        from torchtitan.trainer import Trainer

        from hyperdryrun.parallel.pipeline import static_vote_patches
        from hyperdryrun.world.values import ROUTING_OP, ValueRule, ValueRules, use_rules

        config, t = self.config, self.config.training
        trainer = Trainer.__new__(Trainer)
        trainer.config = config
        trainer.parallel_dims = self.parallel_dims
        trainer.model_config = config.model_spec.model
        trainer.model_parts = self.model_parts
        trainer.loss_fn = self.loss_fn
        trainer.optimizers = optimizers
        trainer.lr_schedulers = self.lr_schedulers
        trainer.metrics_processor = _NoMetrics()
        trainer.checkpointer = _NoCheckpointer()
        trainer.device = next(model.parameters()).device
        trainer.gradient_accumulation_steps = self.gradient_accumulation_steps
        trainer.num_pipeline_parallel_microbatches = self.pp_microbatches
        trainer.pp_schedule = self.pp_schedule
        trainer.pp_has_first_stage, trainer.pp_has_last_stage = (
            self.pp_has_first_stage,
            self.pp_has_last_stage,
        )
        trainer.step, trainer.ntokens_seen = 1, 0
        trainer.train_context = dist_utils.get_spmd_context(
            parallel_dims=self.parallel_dims,
            spmd_typechecking=config.parallelism.spmd_backend == "spmd_types"
            and config.debug.spmd_typechecking,
        )
        body = trainer._forward_backward_body
        trainer.fwd_bwd_fn = body if t.disable_cuda_graphs else wrap_with_cuda_graph(body)
        # train_step logs int(local_valid_tokens); with synthetic batches every label is valid.
        tokens = t.local_batch_size * t.seq_len * self.gradient_accumulation_steps
        given = [
            ValueRule(module=name, op=ROUTING_OP, handler="explicit", counts=list(counts))
            for name, counts in sorted((self.routing or {}).items())
        ]
        rules = ValueRules(
            [
                ValueRule(module="", op="aten._local_scalar_dense.default", handler="value", value=tokens),
                # VarlenAttention's metadata (create_varlen_metadata_for_document) finds each row's document
                # starts with nonzero(positions[b] == 0): the synthetic batches hold one document per row
                ValueRule(module="", op="aten.nonzero.default", handler="size", value=1),
                *given,
                ValueRule(module="*", op=ROUTING_OP, handler="balanced"),
            ]
        )
        record: dict[str, list[list[int]]] = {}
        with (
            self._recorded_routing(record) if self.real else use_rules(rules, root=model),
            PatchSet(
                []
                if self.pp_schedule is None
                else [*static_vote_patches(), *_micro_batch_step_patch(self.pp_schedule)]
            ),
        ):
            Trainer.train_step(trainer, batches)
        if self.real and record:  # the step last run (after the warm-up: the measured one)
            self.metadata["torchtitan"]["routing"] = record

    def _recorded_routing(self, record: dict[str, list[list[int]]]) -> Any:
        """Measured runs: the per-expert token counts of every call of each routed-experts module of this rank's
        model parts (by FQN as the dry run's tracker names modules)."""
        from hyperdryrun.compat.torchtitan_moe import recorded_routing, routed_experts_class
        from hyperdryrun.trace.tensors import clean_fqn

        cls = routed_experts_class()
        parts = self.model_parts if len(self.model_parts) == 1 else [self.model]
        modules = {
            clean_fqn(name): m
            for part in parts
            for name, m in part.named_modules()
            if cls is not None and isinstance(m, cls)
        }
        return recorded_routing(modules, record)

    def plan(self) -> Any:
        """This job as an :class:`~hyperdryrun.engine.JobPlan` (after :meth:`prepare`): the one set-up that the dry
        run and ``measure`` both run. Parameters get their values from torchtitan's ``init_weights``, which
        :meth:`build_optimizers` calls."""
        from hyperdryrun.engine import job_plan

        return job_plan(
            self.build_model,
            self.make_batch,
            step_fn=self.step,
            parallelize_fn=self.parallelize,
            optimizer_fn=self.build_optimizers,
            init_fn=_initialised_later,
            world_size=self.world_size,
            rank=self.rank,
            local_rank=self.local_rank,
            mesh_shape=(self.world_size,),
            mesh_dim_names=("world",),
            target_device=self.target_device,
            num_micro_batches=self.gradient_accumulation_steps * self.pp_microbatches,
            cuda=self._cuda_runtime(),
            metadata=self.metadata,
            held_fn=self._held_buffers,
        )

    def _cuda_runtime(self) -> Any:
        """The CUDA target of the world: the ``gpu`` preset, or the default (None)."""
        if self.gpu is None:
            return None
        from hyperdryrun.world.runtime import CudaRuntime

        return CudaRuntime(gpu=self.gpu)

    def _held_buffers(self) -> Iterator[Any]:
        """The pipeline stages' receive buffers, which the warm-up step of a measured run made and the step keeps
        (the built-in recipe's, :func:`~hyperdryrun.recipe.pipeline_held_buffers`)."""
        from hyperdryrun.recipe import pipeline_held_buffers

        return pipeline_held_buffers(self.pp_schedule)


def _takes_micro_batches(cls: type) -> bool:
    """Whether this torch's schedule ``cls.step`` takes pre-split micro batches
    (:func:`hyperdryrun.compat.torchtitan.takes_micro_batches`)."""
    return titan_compat.takes_micro_batches(cls)


def _micro_batch_step_patch(schedule: Any) -> list[Patch]:
    """torchtitan 0.3.0's pipeline train step on a torch whose ``step`` splits one whole batch
    (:func:`hyperdryrun.compat.torchtitan.micro_batch_step_patches`)."""
    return titan_compat.micro_batch_step_patches(schedule)


def _initialised_later(model: nn.Module) -> None:
    """No values at materialisation: torchtitan's ``init_weights`` runs when its optimizers are built."""
    return None


class JobArgs(TypedDict, total=False):
    """Who runs a torchtitan job and how (the keywords of :func:`torchtitan_job`, :func:`simulate_torchtitan` and
    ``measure_torchtitan``): the rank identity, a layer count cut, the target device, the attention swap, the
    target GPU preset (``gpu``)."""

    world_size: Required[int]
    rank: int
    local_rank: int | None
    n_layers: int | None
    target_device: str
    attention: str | None
    routing: dict[str, list[int]] | None
    gpu: str | None


@contextlib.contextmanager
def torchtitan_job(
    argv: Sequence[str], *, real: bool = False, **args: Unpack[JobArgs]
) -> Iterator[TorchtitanJob]:
    """A prepared :class:`TorchtitanJob` for rank ``rank`` of ``world_size``, inside the patches and restored
    globals that torchtitan needs on this machine (``real``: executed for real, parameters initialised by
    torchtitan). Bad input raises :class:`TorchtitanError`."""
    from hyperdryrun.compat.torchtitan_moe import defined_count_exchange
    from hyperdryrun.world import default_simulation_device

    world_size, rank = args["world_size"], args.get("rank", 0)
    version = torchtitan_version()
    if version is None:
        raise TorchtitanError(
            "torchtitan is not installed; install the extra: pip install 'hyperdryrun[torchtitan]'"
        )
    if world_size < 1:
        raise TorchtitanError(f"--world-size: must be >= 1 (got {world_size})")
    if not 0 <= rank < world_size:
        raise TorchtitanError(f"--rank: must satisfy 0 <= rank < world_size={world_size} (got {rank})")
    if args.get("gpu") is not None:
        from hyperdryrun.world.cuda_target import CudaTarget
        from hyperdryrun.world.gpus import gpu_preset

        try:
            CudaTarget(gpu_preset(args["gpu"]))
        except ValueError as err:
            raise TorchtitanError(str(err)) from None
    from hyperdryrun.compat.torchao import quiet_import

    with quiet_import():  # torchtitan's quantization converters import torchao, which warns on a CPU torch
        import torchtitan.trainer  # noqa: F401  (imports the modules whose device globals are patched)

    job = TorchtitanJob(
        list(argv),
        world_size,
        rank,
        args.get("local_rank"),
        args.get("n_layers"),
        args.get("target_device", "cuda"),
        args.get("attention"),
        real,
        args.get("routing"),
        gpu=args.get("gpu"),
    )
    untested = titan_compat.untested(version)
    if untested is not None:
        job.limitations.append(untested)
    device = "cpu" if real else default_simulation_device()
    with (
        _restored_torchtitan_globals(),
        PatchSet(
            _device_patches(device)
            + families.dist_muon_device_patches(device)
            + _titan_patches(real)
            + (defined_count_exchange() if real else _routing_patches() + families.triton_launch_patches())
        ),
    ):
        job.prepare()
        with PatchSet([] if real else families.fla_block_size_patches()):  # the model's imports are done
            yield job


def simulate_torchtitan(
    argv: Sequence[str], *, capture_stacks: bool = True, **job_args: Unpack[JobArgs]
) -> Any:
    """Dry-run one training step of a torchtitan job (torchtitan's own command line) as rank ``rank`` of
    ``world_size``; returns the :class:`~hyperdryrun.engine.StepTrace`. Bad input raises :class:`TorchtitanError`,
    a failure inside the simulation :class:`~hyperdryrun.engine.SimulationError`."""
    from hyperdryrun.engine import simulate_plan

    with torchtitan_job(argv, **job_args) as job:
        trace = simulate_plan(job.plan(), capture_stacks=capture_stacks)
    trace.limitations = [*trace.limitations, *job.limitations]
    return trace


def measured_routing(trace: Any) -> dict[str, list[int]]:
    """The MoE routing of a measured torchtitan step (``measure_torchtitan``'s trace) as the dry run's ``routing=``:
    per routed-experts module, the per-expert token counts its calls had (one list: its forward and any
    activation-checkpoint recompute route the same tokens). A module whose calls routed differently (several
    micro batches) cannot be given one list: :class:`TorchtitanError`."""
    record = trace.metadata.get("torchtitan", {}).get("routing") or {}
    out = {}
    for name, calls in sorted(record.items()):
        distinct = {tuple(c) for c in calls}
        if len(distinct) != 1:
            raise TorchtitanError(
                f"routing: module {name!r} routed {len(distinct)} different ways in the measured step (one per "
                "micro batch); the dry run's routing rule gives one count list per module"
            )
        out[name] = list(calls[0])
    return out


def routing_from_report(path: str) -> dict[str, list[int]]:
    """The measured MoE routing in a ``--measure`` report (``rank_<r>_memory.json``) as the dry run's ``routing=``
    (``--routing-from``); a file that is not one is a :class:`TorchtitanError` naming the flag and the path."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    try:
        metadata = json.loads(Path(path).read_text())["metadata"]
        record = metadata["torchtitan"]["routing"] if metadata.get("mode") == "measured" else None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TorchtitanError(
            f"--routing-from: not a readable report ({type(err).__name__}: {err}) (got {path!r})"
        ) from None
    valid = isinstance(record, dict) and all(
        isinstance(calls, list)
        and calls
        and all(isinstance(c, list) and all(type(n) is int and n >= 0 for n in c) for c in calls)
        for calls in record.values()
    )
    if not record or not valid:
        raise TorchtitanError(
            "--routing-from: the report holds no measured MoE routing (metadata.torchtitan.routing of a --measure "
            f"report of a MoE job) (got {path!r})"
        )
    return measured_routing(SimpleNamespace(metadata={"torchtitan": {"routing": record}}))


def infer_world_size(argv: Sequence[str]) -> int | None:
    """The world size the parallelism degrees of a torchtitan command line imply, when none is -1 (inferred)."""
    config = load_config(argv)
    p = config.parallelism
    degrees = [
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.context_parallel_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
    ]
    return None if any(d < 1 for d in degrees) else math.prod(degrees)


# ------------------------------------------------------------------------------------------------- many ranks
LAYOUT_FLAGS = {
    "dp_replicate": "--parallelism.data_parallel_replicate_degree",
    "dp_shard": "--parallelism.data_parallel_shard_degree",
    "tp": "--parallelism.tensor_parallel_degree",
    "pp": "--parallelism.pipeline_parallel_degree",
    "cp": "--parallelism.context_parallel_degree",
    "ep": "--parallelism.expert_parallel_degree",
}
"""The torchtitan flag of each parallel degree (``--fit`` sets them; the last of a repeated flag wins)."""


def with_layout(argv: Sequence[str], layout: dict[str, int]) -> list[str]:
    """``argv`` with the degrees of ``layout`` appended (torchtitan's config parser takes the last value given)."""
    return [*argv, *(x for name, degree in layout.items() for x in (LAYOUT_FLAGS[name], str(degree)))]


def rank_classes(argv: Sequence[str], world_size: int, n_layers: int | None = None) -> list[dict[str, Any]]:
    """The rank classes of a torchtitan job over ``world_size`` ranks, ``[{"ranks", "key", "what"}]`` in order of
    their lowest rank: ranks that run the same step (the rules of :mod:`hyperdryrun.search.classes`) share a class.

    torchtitan's mesh is laid out as the recipe's (``pp, dp_replicate, dp_shard, cp, tp``, row-major), so
    :meth:`~hyperdryrun.parallel.dims.ParallelDims.coordinates` places each rank. The pipeline stage and the
    context-parallel position always set ranks apart; the data-parallel replica never does; ``dp_shard`` and ``tp``
    positions only where a parameter of the model (built on meta) splits unevenly over TP and FSDP (``torch.chunk``
    leaves the last ranks smaller shards), or with EP (its token routing and expert shards, kept apart whole).
    Bad input raises :class:`TorchtitanError`."""
    from hyperdryrun.parallel.dims import ParallelDims

    with torchtitan_job(argv, world_size=world_size, n_layers=n_layers) as job:
        degrees = job.metadata["parallel"]
        with torch.device("meta"):
            shapes = [tuple(p.shape) for p in job.build_model().parameters()]
    tp, fsdp = degrees["tp"], degrees["dp_shard"] * degrees["cp"]
    # TP splits one dim of a parameter, FSDP2 dim 0 of the TP-local tensor: even when every dim divides by tp and
    # dim 0 by tp * fsdp (n % (tp * f) == 0 makes both n and n / tp divide by f)
    even = all(
        all(n % tp == 0 for n in shape) and (not shape or shape[0] % (tp * fsdp) == 0) for shape in shapes
    )
    dims = ParallelDims(
        world_size,
        degrees["dp_replicate"],
        degrees["dp_shard"],
        degrees["cp"],
        tp,
        degrees["pp"],
        degrees["ep"],
    )
    groups: dict[str, dict[str, Any]] = {}
    for rank in range(world_size):
        c = dims.coordinates(rank)
        key = {"pp": c.pp, "cp": c.cp}
        if not even or degrees["ep"] > 1:
            key.update(dp_shard=c.dp_shard, tp=c.tp)
        name = json.dumps(key, sort_keys=True)
        group = groups.setdefault(name, {"ranks": [], "key": key})
        group["ranks"].append(rank)
    for group in groups.values():
        group["what"] = ", ".join(f"{k} {v}" for k, v in group["key"].items())
    return list(groups.values())
