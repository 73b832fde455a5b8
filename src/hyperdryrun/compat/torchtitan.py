"""torchtitan internals a dry run replaces, and what torchtitan needs of torch, by release (torchtitan 0.3.0, the
release the ``hyperdryrun[torchtitan]`` extra pins; its file named in each entry).

:mod:`hyperdryrun.integrations.torchtitan` runs torchtitan's job as it is and asks this module for the patches.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hyperdryrun.compat.versions import torch_version
from hyperdryrun.patches import Patch, PatchSet

TESTED_VERSION = "0.3.0"
"""The torchtitan release this integration is tested with (the ``hyperdryrun[torchtitan]`` extra pins it)."""


def torchtitan_version() -> str | None:
    """The installed torchtitan's version (its package metadata), or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def quiet_logger() -> Iterator[None]:
    """torchtitan's logger at ERROR inside (it logs to the root logger, lines that speak of a real run), its level
    put back on exit."""
    from torchtitan.tools.logging import logger as titan_logger

    level = titan_logger.level
    titan_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        titan_logger.setLevel(level)


def set_spmd_backend(name: str) -> None:
    """torchtitan's SPMD backend for the job being built, as its Trainer sets it (a process global:
    :func:`restored_globals` puts the previous one back)."""
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend(name)


@contextlib.contextmanager
def restored_globals() -> Iterator[None]:
    """torchtitan sets process globals while it builds a job (the SPMD backend, dynamo and Inductor configs in
    apply_compile, the symmetric-memory store of async TP), and logs to the root logger (quiet inside): all
    restored on exit."""
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config
    import torch.distributed._symmetric_memory as symm_mem
    import torchtitan.distributed.utils as titan_dist

    configs = [torch._dynamo.config, torch._functorch.config, torch._inductor.config]
    saved = [c.get_config_copy() for c in configs]
    symm_stores = dict(symm_mem._group_name_to_store)  # async TP enables symmetric memory for the tp group
    backend = titan_dist.get_spmd_backend()

    def enable_symm_mem_for_group(group_name: str) -> None:
        symm_mem._group_name_to_store.setdefault(group_name, None)

    symm_group = Patch(
        symm_mem,
        "enable_symm_mem_for_group",
        enable_symm_mem_for_group,
        reason="torch 2.13's enable_symm_mem_for_group registers the group with C++ "
        "(_SymmetricMemory.set_group_info), which no API undoes and which refuses a name it has seen: a second "
        "async-TP job in one process failed. Inside, the group is only marked enabled (what Inductor's async-TP "
        "pass checks); nothing is staged in symmetric memory by fake or CPU kernels",
    )
    try:
        with quiet_logger(), PatchSet([symm_group]):  # its INFO/WARNING lines speak of a real run
            yield
    finally:
        titan_dist.set_spmd_backend(backend)
        symm_mem._group_name_to_store.clear()
        symm_mem._group_name_to_store.update(symm_stores)
        for config, values in zip(configs, saved):
            now = config.get_config_copy()
            for key, value in values.items():
                if now.get(key) is not value and now.get(key) != value:
                    setattr(config, key, value)


def untested(version: str) -> str | None:
    """A limitation line when ``version`` of torchtitan is not :data:`TESTED_VERSION`, else None."""
    if version != TESTED_VERSION:
        return f"torchtitan {version} is not the tested {TESTED_VERSION}"
    return None


def device_patches(simulation_device: str) -> list[Patch]:
    """torchtitan resolves its device type at import (``tools.utils.device_type``: ``"cuda"`` when no accelerator is
    present) and modules copy it; in the simulated world the device is the simulation device. torchtitan 0.3.0:
    every loaded ``torchtitan.*`` module whose ``device_type`` / ``device_module`` is the one resolved."""
    import torchtitan.tools.utils as titan_utils

    resolved, resolved_module = titan_utils.device_type, titan_utils.device_module
    if resolved == simulation_device:
        return []
    from torch._utils import _get_device_module

    module = _get_device_module(simulation_device)
    patches = []
    for name, mod in sorted(sys.modules.items()):
        if mod is None or not (name == "torchtitan" or name.startswith("torchtitan.")):
            continue
        if getattr(mod, "device_type", None) == resolved:
            patches.append(
                Patch(
                    mod,
                    "device_type",
                    simulation_device,
                    f"torchtitan {name}.device_type is {resolved!r} (resolved at import without an accelerator); "
                    f"the simulated world's tensors are on {simulation_device!r}",
                )
            )
        if getattr(mod, "device_module", None) is resolved_module:
            patches.append(
                Patch(mod, "device_module", module, f"torchtitan {name}.device_module follows device_type")
            )
    return patches


def fake_tensor_patches(real: bool = False) -> list[Patch]:
    """What torchtitan needs on fake tensors (``real``: executed for real, its parameter initialisation runs).

    torchtitan 0.3.0: ``torchtitan/protocols/module.py`` (``Module._init_self_parameters``) and
    ``torchtitan/distributed/activation_checkpoint.py`` (``_disable_dynamo_lru_cache``)."""
    import torchtitan.distributed.activation_checkpoint as titan_ac
    import torchtitan.protocols.module as titan_module

    def no_parameter_init(self: Any) -> None:
        return None

    def keep_lru_cache() -> None:
        return None

    no_init = [
        Patch(
            titan_module.Module,
            "_init_self_parameters",
            no_parameter_init,
            "torchtitan's init_states initialises parameters with torch 2.13 nn.init.trunc_normal_, whose rejection "
            "sampling reads values (if not mask.any()), which fake tensors lack; parameter values do not change "
            "memory (buffers are still initialised)",
        ),
    ]
    return [
        *([] if real else no_init),
        Patch(
            titan_ac,
            "_disable_dynamo_lru_cache",
            keep_lru_cache,
            "torchtitan's activation checkpointing turns off dynamo's C++ LRU cache of compiled graphs, a process "
            "global with no getter to restore it; in a dry run compiled regions run eagerly, so it has no effect",
        ),
    ]


def routing_patches(token_counts: Callable[[], Callable[[int, int, int], list[int]] | None]) -> list[Patch]:
    """torchtitan's expert-parallel all-to-all reads its split sizes from the routing (``.tolist()`` of token
    counts per EP rank); on fake tensors they come from ``token_counts()``: None when executed for real (then
    torchtitan's own exchange runs), else ``counts(tokens, experts, top_k)``, the tokens each expert receives.

    torchtitan 0.3.0 ``torchtitan/models/common/token_dispatcher.py``: ``AllToAllTokenDispatcher._local_reorder``
    and ``_sync_token_count_exchange``."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    cls = AllToAllTokenDispatcher
    reorder = cls._local_reorder

    def local_reorder(self: Any, x_TD: Any, topk_scores_TK: Any, topk_expert_ids_TK: Any) -> Any:
        self._hyperdryrun_tokens_topk = tuple(topk_expert_ids_TK.shape)
        return reorder(self, x_TD, topk_scores_TK, topk_expert_ids_TK)

    def sync_token_count_exchange(
        self: Any,
        num_local_tokens_per_expert_E: Any,
        num_global_tokens_per_local_expert_EP_e: Any,
        ep_size: int,
    ) -> tuple[Any, list[int], list[int]]:
        count = token_counts()
        if count is None:  # executed for real (measure): torchtitan's own exchange
            return sync(self, num_local_tokens_per_expert_E, num_global_tokens_per_local_expert_EP_e, ep_size)
        tokens, top_k = self._hyperdryrun_tokens_topk
        experts = num_local_tokens_per_expert_E.shape[0]
        counts = count(tokens, experts, top_k)
        local = experts // ep_size
        per_rank = [sum(counts[r * local : (r + 1) * local]) for r in range(ep_size)]
        mine = per_rank[self.ep_mesh.get_local_rank()]
        received = torch.ops._c10d_functional.wait_tensor(num_global_tokens_per_local_expert_EP_e)
        return received.reshape(-1), per_rank, [mine] * ep_size

    sync = cls._sync_token_count_exchange
    why = (
        "torchtitan 0.3.0's AllToAllTokenDispatcher reads the all-to-all split sizes with .tolist() (a device-to-"
        "host sync of routing counts), which fake tensors cannot answer"
    )
    return [
        Patch(cls, "_local_reorder", local_reorder, f"{why}: records the tokens and top-k it routes"),
        Patch(
            cls, "_sync_token_count_exchange", sync_token_count_exchange, f"{why}: the routing rule's counts"
        ),
    ]


def takes_micro_batches(cls: type) -> bool:
    """Whether this torch's schedule ``cls.step`` takes pre-split micro batches (``arg_mbs=``, as torchtitan 0.3.0 calls
    it); torch 2.13.0's splits one whole batch and takes other keywords as the model's."""
    return "arg_mbs" in inspect.signature(cls.step).parameters


def micro_batch_step_patches(schedule: Any) -> list[Patch]:
    """torchtitan 0.3.0's pipeline train step on torch 2.13: ``step(arg_mbs=, kwarg_mbs=, target_mbs=)`` runs 2.13's
    own ``step`` without its split, the micro batches going to its ``_step_microbatches`` as given."""
    cls = type(schedule)
    if takes_micro_batches(cls):
        return []
    original = cls.step

    def step(
        self: Any, *args: Any, arg_mbs: Any = None, kwarg_mbs: Any = None, target_mbs: Any = None, **kw: Any
    ) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return original(self, *args, **kw)
        losses, return_outputs = kw.pop("losses", None), kw.pop("return_outputs", True)
        loss_kwargs = kw.pop("loss_kwargs", None)
        if args or kw:
            raise TypeError(
                f"a pipeline step with micro batches takes no whole-batch inputs (got {len(args)}, {sorted(kw)})"
            )
        stages = getattr(self, "_stages", None) or [self._stage]
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )
        return (
            None
            if not return_outputs
            else next((self._merge_outputs(s.output_chunks) for s in stages if s.is_last), None)
        )

    return [
        Patch(
            cls,
            "step",
            step,
            f"torchtitan 0.3.0 calls {cls.__name__}.step(arg_mbs=, kwarg_mbs=, target_mbs=) with pre-split micro "
            f"batches, which torch {torch_version()} lacks: its step splits one whole batch and passes the other "
            "keywords to the model (ValueError: Expecting n arg_mbs but got 1)",
        )
    ]


def pipeline_stage_patch(titan_pp: Any, stage: Callable[..., Any]) -> Patch:
    """``torchtitan.distributed.pipeline_parallel.PipelineStage`` replaced by ``stage`` (a stage built with static
    example shapes). torchtitan 0.3.0 ``pipeline_parallel.py`` builds ``PipelineStage`` without them."""
    return Patch(
        titan_pp,
        "PipelineStage",
        stage,
        "torchtitan 0.3.0 builds PipelineStage without example shapes, so torch 2.13 infers them at the first "
        "step by running each stage and exchanging the metadata over p2p with the neighbouring ranks, which one "
        "process on a fake process group cannot do",
    )
