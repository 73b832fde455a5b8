"""The model families of the built-in recipe and their presets (torchtitan's ``TrainSpec``, model half).

A family registers what the model layer knows: its argument class and presets, the model class, the parameter
initialiser of real runs and the cut to one pipeline stage. How it is parallelized (TP/EP plans, the parallelize
function) is registered one layer up, in :mod:`hyperdryrun.parallel.train_spec`; the job config, the ``--model``
help and the recipe read both, so a new family is one entry in each and no dispatch to edit.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hyperdryrun.models import hf
from hyperdryrun.models.shapes import LLAMA_PRESETS, MOE_PRESETS, LlamaArgs, MoEArgs

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    """One model family: ``build(args, max_seq_len)`` makes the model, ``init_weights(model)`` gives a built
    (possibly sharded) model real values, ``pipeline_cut(model, layers, embedding, head)`` reduces it to a stage."""

    name: str
    args_cls: type
    presets: Mapping[str, Any]
    build: Callable[[Any, int], nn.Module]
    init_weights: Callable[[nn.Module], None]
    pipeline_cut: Callable[[nn.Module, range, bool, bool], None]
    is_moe: bool = False
    """Routed experts: expert parallel, the routing scenario and the MoE fields of the job config apply."""
    label: str = ""
    """How the ``--model`` help introduces this family's presets ("MoE: ..."); none for the first family."""
    logits: Callable[[nn.Module, Any], Any] | None = None
    """``logits(model, tokens)`` when the model's forward does not return the logits itself (Hugging Face)."""
    loss: Callable[[nn.Module, Any], Any] | None = None
    """``loss(model, batch)``: the model's own loss (``training.loss: model``) where it is not the built-in fp32
    cross entropy of the logits (Hugging Face: ``labels=`` through the model's ``loss_function``)."""
    prefix: str = ""
    """Model names of the form ``<prefix>NAME`` belong to this family (``hf:``), besides its presets."""


def _torch_code(module: str, name: str) -> Callable[..., Any]:
    """``module.name`` (a dotted attribute path), imported when first called: the registry, the job config and the
    ``--model`` help read the families without importing torch; building or initialising a model imports it."""

    def call(*args: Any, **kwargs: Any) -> Any:
        target: Any = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        return target(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``{module}.{name}``, imported on first call."
    return call


_FAMILIES: dict[str, ModelFamily] = {}
_BY_PRESET: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` and its presets; a family or preset name already taken is an error."""
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    taken = sorted(set(family.presets) & set(_BY_PRESET))
    if taken:
        raise ValueError(f"model preset {taken[0]!r} is already registered by {_BY_PRESET[taken[0]].name!r}")
    _FAMILIES[family.name] = family
    _BY_PRESET.update(dict.fromkeys(family.presets, family))
    return family


def families() -> list[ModelFamily]:
    """The registered families, in registration order."""
    return list(_FAMILIES.values())


def family_of(preset: str) -> ModelFamily:
    """The family a preset name (or a ``<prefix>NAME`` model name) belongs to (KeyError if none)."""
    for family in _FAMILIES.values():
        if family.prefix and preset.startswith(family.prefix):
            return family
    return _BY_PRESET[preset]


def family_of_args(args: Any) -> ModelFamily:
    """The family whose argument class ``args`` is (exactly, else by inheritance)."""
    for match in (lambda f: type(args) is f.args_cls, lambda f: isinstance(args, f.args_cls)):
        for family in _FAMILIES.values():
            if match(family):
                return family
    raise KeyError(f"no model family takes {type(args).__name__}")


def preset_names() -> list[str]:
    """Every preset of every family, sorted (the choices the job config offers)."""
    return sorted(_BY_PRESET)


def presets_help() -> str:
    """The presets as the ``--model`` help lists them: per family, in registration order."""
    parts = [
        (f"{f.label}: " if f.label else "") + ", ".join(f.presets) for f in _FAMILIES.values() if f.presets
    ]
    return "; ".join(parts)


LLAMA = register_family(
    ModelFamily(
        name="llama",
        args_cls=LlamaArgs,
        presets=LLAMA_PRESETS,
        build=_torch_code("hyperdryrun.models.llama", "LlamaTransformer"),
        init_weights=_torch_code("hyperdryrun.models.llama", "init_llama_weights"),
        pipeline_cut=_torch_code("hyperdryrun.models.llama", "DecoderLM.keep_stage"),
    )
)
MOE = register_family(
    ModelFamily(
        name="moe",
        args_cls=MoEArgs,
        presets=MOE_PRESETS,
        build=_torch_code("hyperdryrun.models.moe", "MoETransformer"),
        init_weights=_torch_code("hyperdryrun.models.moe", "init_moe_weights"),
        pipeline_cut=_torch_code("hyperdryrun.models.llama", "DecoderLM.keep_stage"),
        is_moe=True,
        label="MoE",
    )
)
HF = register_family(
    ModelFamily(
        name="hf",
        args_cls=hf.HFArgs,
        presets={},
        build=hf.build_hf_model,
        init_weights=hf.init_hf_weights,
        pipeline_cut=hf.hf_pipeline_cut,
        is_moe=True,
        label="Hugging Face",
        logits=hf.hf_logits,
        loss=hf.hf_loss,
        prefix=hf.HF_PREFIX,
    )
)
"""Hugging Face causal LMs (``hf:NAME``): dense or MoE by their config.json (``HFArgs.is_moe``); ``is_moe`` here
lets the MoE layout checks and the routing scenario see them."""
