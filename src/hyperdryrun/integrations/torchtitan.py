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
from collections.abc import Iterator, Sequence
from typing import Any, Required, TypedDict, Unpack

import torch
from torch import nn

from hyperdryrun.compat import torch_fsdp
from hyperdryrun.compat import torchtitan as titan_compat
from hyperdryrun.compat import torchtitan_families as families
from hyperdryrun.compat.torchtitan import torchtitan_version
from hyperdryrun.compat.versions import torch_version
from hyperdryrun.config import check_rank
from hyperdryrun.integrations.torchtitan_config import ConfigChecks, TorchtitanError, load_config
from hyperdryrun.patches import Patch, PatchSet

SPMD_BACKEND_FLAGS = ("--parallelism.spmd_backend", "--parallelism.spmd-backend")


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
class TorchtitanJob(ConfigChecks):
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
    routing_spec: Any = None
    """The routing option (:class:`~hyperdryrun.world.routing.RoutingSpec`: ``--routing``, ``--skew``,
    ``--routing-from``...), tried after ``routing``; a measured run (``real``) forces its router to the same counts
    when it is given (None: the router decides)."""
    cuda: Any = None
    """The CUDA runtime of a CUDA target (:class:`~hyperdryrun.world.runtime.CudaRuntime`: the GPU preset's SDPA
    rules, cuBLAS workspace and capacity, the allocator settings); None: the defaults."""
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
        self.config = config = load_config(self.argv, self.cuda.gpu if self.cuda is not None else None)
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
                "compile.enable_async_tensor_parallel: for a CUDA target Inductor's async-TP pass fuses the TP "
                "all-gathers and reduce-scatters of the compiled regions with their matmuls as on the GPU (the "
                "'async TP' line counts them); for a CPU target nothing is fused, as torch fuses only where NCCL is "
                "built in"
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

        config = self.config
        self.parallel_dims = dims = ParallelDims.from_config(config.parallelism, self.world_size)
        titan_compat.set_spmd_backend(config.parallelism.spmd_backend)
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
        if self.routing_spec is not None:
            given += self.routing_spec.routing_rules()
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
        forced = self.real and self.routing_spec is not None
        with (
            self._forced_routing(ValueRules(given)) if forced else contextlib.nullcontext(),
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

    def _forced_routing(self, rules: Any) -> Any:
        """Measured runs given a routing: every router of this rank's model parts picks the experts that give each
        routed layer the counts of ``rules`` (:func:`hyperdryrun.compat.torchtitan_moe.forced_routing`)."""
        from hyperdryrun.compat.torchtitan_moe import forced_routing
        from hyperdryrun.trace.tensors import clean_fqn

        parts = self.model_parts if len(self.model_parts) == 1 else [self.model]
        moes = {
            clean_fqn(name): m for part in parts for name, m in part.named_modules() if hasattr(m, "router")
        }
        return forced_routing(
            {f"{name}.routed_experts": m.router for name, m in moes.items() if hasattr(m, "routed_experts")},
            rules.token_counts,
        )

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
            cuda=self.cuda,
            num_micro_batches=self.gradient_accumulation_steps * self.pp_microbatches,
            metadata=self.metadata,
            held_fn=self._held_buffers,
        )

    def _held_buffers(self) -> Iterator[Any]:
        """The pipeline stages' receive buffers, which the warm-up step of a measured run made and the step keeps
        (the built-in recipe's, :func:`~hyperdryrun.recipe.pipeline_held_buffers`)."""
        from hyperdryrun.recipe import pipeline_held_buffers

        return pipeline_held_buffers(self.pp_schedule)


def _micro_batch_step_patch(schedule: Any) -> list[Patch]:
    """torchtitan 0.3.0's pipeline train step on a torch whose ``step`` splits one whole batch
    (:func:`hyperdryrun.compat.torchtitan.micro_batch_step_patches`)."""
    return titan_compat.micro_batch_step_patches(schedule)


def _initialised_later(model: nn.Module) -> None:
    """No values at materialisation: torchtitan's ``init_weights`` runs when its optimizers are built."""
    return None


class JobArgs(TypedDict, total=False):
    """Who runs a torchtitan job and how (the keywords of :func:`torchtitan_job`, :func:`simulate_torchtitan` and
    ``measure_torchtitan``): the rank identity, a layer count cut, the target device, the attention swap."""

    world_size: Required[int]
    rank: int
    local_rank: int | None
    n_layers: int | None
    target_device: str
    attention: str | None
    routing: dict[str, list[int]] | None
    routing_spec: Any
    """The routing option (:class:`~hyperdryrun.world.routing.RoutingSpec`); a measured run forces it."""
    cuda: Any
    """A CUDA target's :class:`~hyperdryrun.world.runtime.CudaRuntime` (``--gpu``, ``--alloc-conf``)."""


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
    check_rank(rank, world_size, TorchtitanError)
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
        args.get("routing_spec"),
        None if real else args.get("cuda"),
    )
    untested = titan_compat.untested(version)
    if untested is not None:
        job.limitations.append(untested)
    device = "cpu" if real else default_simulation_device()
    with (
        titan_compat.restored_globals(),
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
