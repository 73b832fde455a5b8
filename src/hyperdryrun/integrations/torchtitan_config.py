"""torchtitan's config as a torchtitan job's dry run reads it: its own command line parsed by its ConfigManager
(:func:`load_config`, one-line :class:`TorchtitanError` for what it rejects), and the checks and report metadata of
a prepared :class:`~hyperdryrun.integrations.torchtitan.TorchtitanJob` (:class:`ConfigChecks`, the job's base):
what of pipelining, MoE routing and the attention swap the dry run runs, and what it states as limitations."""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Sequence
from typing import Any

from hyperdryrun.compat import torchtitan_families as families
from hyperdryrun.compat.torchtitan import TESTED_VERSION, torchtitan_version
from hyperdryrun.compat.versions import torch_version
from hyperdryrun.config import ConfigError

SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""torch.distributed.pipelining schedules that run a stage's backward in two parts (input gradients, then weights)."""


class TorchtitanError(ConfigError):
    """A torchtitan job the dry run cannot run as given; the message is one line naming the field (bad input, as
    a :class:`~hyperdryrun.config.ConfigError`, also for the runner's workers)."""


def load_config(argv: Sequence[str], gpu: str | None = None) -> Any:
    """torchtitan's ``Trainer.Config`` from its own command line (``--module``, ``--config``, overrides); the GPU
    checks of its quantization converters (float8, MXFP8, NVFP4) answer as ``gpu`` (a preset; default: the
    default CUDA target's), :func:`hyperdryrun.compat.torchao.capability_patches`."""
    from hyperdryrun.compat import torchao as ao_compat
    from hyperdryrun.patches import PatchSet
    from hyperdryrun.world.gpus import DEFAULT_GPU, gpu_preset

    try:
        with ao_compat.quiet_import():
            from torchtitan.config import ConfigManager
    except ImportError as err:
        raise TorchtitanError(
            f"torchtitan is not importable ({err}); install the extra: pip install 'hyperdryrun[torchtitan]'"
        ) from None
    from hyperdryrun.compat.torchtitan import quiet_logger

    preset = gpu_preset(gpu or DEFAULT_GPU)
    ao_compat.import_quantization_modules()
    printed = io.StringIO()
    try:
        with quiet_logger():  # torchtitan's warnings speak of a real run
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


class ConfigChecks:
    """The config checks and report metadata of :class:`~hyperdryrun.integrations.torchtitan.TorchtitanJob` (its
    base: the methods read the job's parsed ``config``, ``argv``, ``world_size`` and fill its ``limitations`` and
    ``metadata``)."""

    config: Any
    argv: list[str]
    world_size: int
    attention: str | None
    real: bool
    routing: dict[str, list[int]] | None
    routing_spec: Any
    limitations: list[str]
    metadata: dict[str, Any]
    gradient_accumulation_steps: int
    pp_microbatches: int

    def _check_pipeline(self, dims: Any) -> None:
        """What the dry run runs of torchtitan's pipelining: its ``pipelining_fn`` with a schedule of
        torch.distributed.pipelining, alone or with FSDP/HSDP; the rest is one line naming the field."""
        from torchtitan.distributed.activation_checkpoint import SelectiveAC

        from hyperdryrun.parallel_dims import PIPELINE_SCHEDULES

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
        spec = self.routing_spec
        if moe and self.real and spec is not None:
            self.limitations.append(
                f"MoE routing forced: every router picked the experts that give its layer the counts of {spec.describe()}"
                " (torchtitan's _debug_force_load_balance override point; every EP rank routes alike)"
            )
        if not moe or self.real or dims.ep == 1:
            return
        given = sorted(self.routing or {})
        if given:
            how = f"the given per-expert counts for {', '.join(given)} (routing=), "
            how += f"then {spec.describe()}" if spec is not None else "balanced for any other"
        elif spec is not None:
            how = spec.describe()
        else:
            how = (
                "balanced (every expert gets tokens x top_k / experts; --routing, --skew, --routing-from give "
                "another, docs/MOE.md)"
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


def _takes_micro_batches(cls: type) -> bool:
    """Whether this torch's schedule ``cls.step`` takes pre-split micro batches
    (:func:`hyperdryrun.compat.torchtitan.takes_micro_batches`)."""
    from hyperdryrun.compat import torchtitan as titan_compat

    return titan_compat.takes_micro_batches(cls)


__all__ = ["ConfigChecks", "TorchtitanError", "load_config"]
