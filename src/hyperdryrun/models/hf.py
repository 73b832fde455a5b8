"""Hugging Face causal LMs built from a config.json (``--model hf:NAME``), never downloaded.

``NAME`` is a config shipped in ``hf_configs/`` (written from the published config.json files), a directory holding a
config.json, or a config.json itself. The model is HF's own code, ``AutoModelForCausalLM.from_config``; it is
parallelized from outside by :mod:`hyperdryrun.parallel.hf`. transformers is an optional extra
(``pip install 'hyperdryrun[hf]'``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a model is built: the job config reads this module without it
    import torch
    from torch import nn

HF_PREFIX = "hf:"
CONFIG_DIR = Path(__file__).with_name("hf_configs")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")

# The job config's shape overrides -> config.json keys (the first key the config has wins).
OVERRIDE_KEYS: dict[str, tuple[str, ...]] = {
    "n_layers": ("num_hidden_layers",),
    "dim": ("hidden_size",),
    "n_heads": ("num_attention_heads",),
    "n_kv_heads": ("num_key_value_heads",),
    "ffn_dim": ("intermediate_size",),
    "vocab_size": ("vocab_size",),
    "norm_eps": ("rms_norm_eps",),
    "tie_embeddings": ("tie_word_embeddings",),
    "num_experts": ("num_local_experts", "num_experts"),
    "top_k": ("num_experts_per_tok",),
    "moe_ffn_dim": ("moe_intermediate_size",),
}


def shipped_configs() -> list[str]:
    """Names of the configs shipped with the package (``--model hf:<name>``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def is_hf_name(name: str) -> bool:
    return name.startswith(HF_PREFIX)


def config_path(name: str) -> Path:
    """The config.json that ``hf:NAME`` names: a shipped config, a directory with a config.json, or the file."""
    source = name.removeprefix(HF_PREFIX)
    if (CONFIG_DIR / f"{source}.json").is_file():
        return CONFIG_DIR / f"{source}.json"
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model {name}: no shipped config {source!r} ({', '.join(shipped_configs())}) and no config.json "
            f"at {str(path)!r}"
        )
    return path


def read_config(name: str) -> dict[str, Any]:
    """The config.json dict of ``hf:NAME`` (one-line errors for a missing, too large or bad JSON file, no
    model_type), read within the limits of :mod:`hyperdryrun.ingest.files` like every other input."""
    from hyperdryrun.ingest.files import CONFIG_BYTES, IngestError, read_bytes, read_json

    path = config_path(name)
    try:
        data = read_json(path, read_bytes(path, CONFIG_BYTES))
    except IngestError as err:
        raise ValueError(f"--model {name}: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(
            f'--model {name}: {str(path)!r} has no "model_type" (not a Hugging Face config.json)'
        )
    return data


REQUIRED_FIELDS = ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size")
"""The shape fields the dry run reads from every config.json (through :data:`OVERRIDE_KEYS`)."""
OPTIONAL_COUNTS = ("n_kv_heads", "num_experts", "top_k", "moe_ffn_dim")


def check_fields(args: HFArgs) -> None:
    """One line naming the config and its field unless the fields the dry run reads hold usable values: a
    ``model_type`` transformers knows, positive integer sizes, a head count that divides the width, counts of
    experts that make sense (transformers itself would fail on them later, with a traceback)."""
    where = f"--model {args.name}: {str(config_path(args.name))!r}"

    def key_of(field_name: str) -> str:
        return next((k for k in OVERRIDE_KEYS[field_name] if k in args.config), OVERRIDE_KEYS[field_name][0])

    def bad(key: str, rule: str) -> ValueError:
        if key not in args.config:
            return ValueError(f"{where}: field {key}: {rule}")
        value = args.config[key]
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        return ValueError(f"{where}: field {key}: {rule} (got {shown})")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for name in REQUIRED_FIELDS:
        value = args._get(name)
        if not is_int(value) or value < 1:
            raise bad(key_of(name), "must be a positive integer" if value is not None else "missing")
    for name in OPTIONAL_COUNTS:
        value = args._get(name)
        if value is not None and (not is_int(value) or value < (1 if name == "n_kv_heads" else 0)):
            raise bad(key_of(name), "must be a positive integer" if name == "n_kv_heads" else "must be >= 0")
    head_dim = args.config.get("head_dim")
    if head_dim is not None and (not is_int(head_dim) or head_dim < 1):
        raise bad("head_dim", "must be a positive integer")
    if head_dim is None and args.dim % args.n_heads:
        raise bad(key_of("n_heads"), f"must divide {key_of('dim')}={args.dim}")
    if args.n_heads % args.n_kv_heads:
        raise bad(key_of("n_kv_heads"), f"must divide {key_of('n_heads')}={args.n_heads}")
    if args.num_experts and not 1 <= args.top_k <= args.num_experts:
        raise bad(key_of("top_k"), f"must be in 1..{key_of('num_experts')}={args.num_experts}")
    mapping = getattr(getattr(transformers_module(), "models", None), "auto", None)
    known = getattr(getattr(mapping, "configuration_auto", None), "CONFIG_MAPPING_NAMES", None)
    if known is not None and args.model_type not in known:
        raise bad("model_type", "not a model type this transformers knows")
    for key, value in args.config.items():
        if _non_finite(value):
            raise bad(key, "must be a finite number (JSON has no NaN or Infinity)")
    problem = _CHECKED.get(key_ := (args.name, json.dumps(args.config, sort_keys=True, default=str)))
    if key_ not in _CHECKED:
        problem = _CHECKED[key_] = _causal_lm_problem(args)
    if problem is not None:
        raise bad(*problem) if isinstance(problem, tuple) else ValueError(problem)


_CHECKED: dict[tuple[str, str], Any] = {}
""":func:`_causal_lm_problem` of each config checked in this process (a search checks the same one per candidate)."""


def _non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_non_finite(v) for v in value)
    return False


def _causal_lm_problem(args: HFArgs) -> tuple[str, str] | str | None:
    """Why transformers cannot build ``args``'s config as the decoder-only causal LM the dry run parallelizes
    (``model.model.layers``): transformers' own refusal (``rope_scaling`` without its keys), no causal-LM class
    (T5), or one that keeps its layers elsewhere (BERT's ``bert.encoder.layer``, GPT-2's ``transformer.h``); None
    when it can. Found here, with the job's other checks, not as an internal error half-way through the step."""
    try:
        config = args.hf_config()
    except ValueError as err:
        return str(err)
    except (
        Exception
    ) as err:  # transformers' own validators (huggingface_hub's StrictDataclass...) on the file
        first = str(err).splitlines()[0] if str(err) else ""
        return f"--model {args.name}: transformers cannot build this config: {type(err).__name__}: {first}"
    mapping = transformers_module().AutoModelForCausalLM._model_mapping
    cls = mapping[type(config)] if type(config) in mapping else None
    if cls is None:
        return ("model_type", "has no causal language model in transformers (AutoModelForCausalLM)")
    prefix = getattr(cls, "base_model_prefix", None)
    if prefix != "model":
        return (
            "model_type",
            f"{cls.__name__} keeps its layers under {prefix!r}, not 'model.layers': not the decoder-only layout "
            "the dry run parallelizes (Llama, Qwen, Mixtral, ...)",
        )
    return None


def transformers_module() -> Any:
    """transformers, or a one-line error saying how to install it. torchao, which transformers' model modules import
    when it is installed, is imported first with its CPU-torch warnings silenced (:func:`quiet_import`): they
    reached the terminal of every HF job, bad input's one line included."""
    from hyperdryrun.compat.torchao import quiet_import

    try:
        with quiet_import():
            import transformers
            import transformers.modeling_utils  # noqa: F401  (what imports torchao's safetensors, MX modules)
    except ImportError:
        raise ValueError(
            "--model hf:...: Hugging Face models need transformers: pip install 'hyperdryrun[hf]'"
        ) from None
    return transformers


@dataclass(frozen=True, eq=False)
class HFArgs:
    """A Hugging Face model: its config.json dict (overrides applied) and the attention and experts kernels."""

    name: str
    config: dict[str, Any] = field(repr=False)
    attn_implementation: str = "sdpa"
    experts_implementation: str | None = None
    """HF's MoE experts kernel; None: transformers' default (``grouped_mm`` where torch has it)."""

    def _get(self, field_name: str, default: Any = None) -> Any:
        for key in OVERRIDE_KEYS[field_name]:
            if key in self.config:
                return self.config[key]
        return default

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def dim(self) -> int:
        return self._get("dim")

    @property
    def n_layers(self) -> int:
        return self._get("n_layers")

    @property
    def n_heads(self) -> int:
        return self._get("n_heads")

    @property
    def n_kv_heads(self) -> int:
        return self._get("n_kv_heads") or self.n_heads

    @property
    def head_dim(self) -> int:
        """The config's ``head_dim`` where it has one (Qwen3 sets it apart from the width), else dim / heads."""
        return self.config.get("head_dim") or self.dim // self.n_heads

    @property
    def head_dim_override(self) -> bool:
        return bool(self.config.get("head_dim"))

    @property
    def ffn_dim(self) -> int:
        return self._get("ffn_dim")

    @property
    def vocab_size(self) -> int:
        return self._get("vocab_size")

    @property
    def tie_embeddings(self) -> bool:
        return bool(self._get("tie_embeddings", False))

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model)."""
        return self._get("num_experts", 0) or 0

    @property
    def top_k(self) -> int:
        return self._get("top_k", 0) or 0

    @property
    def moe_ffn_dim(self) -> int:
        return self._get("moe_ffn_dim") or (self.ffn_dim if self.num_experts else 0)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # What the MoE layout checks read; HF's MoE configs shipped here have neither.
    num_shared_experts = 0
    n_dense_layers = 0
    attention = "gqa"
    fuse_qkv = False
    """HF's attention has separate q_proj, k_proj and v_proj (what ``fit``'s rank classes count)."""

    def hf_config(self) -> Any:
        """The transformers config (``AutoConfig.for_model``, no hub access)."""
        transformers = transformers_module()
        rest = {k: v for k, v in self.config.items() if k != "model_type"}
        try:
            return transformers.AutoConfig.for_model(self.model_type, **rest)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"--model {self.name}: transformers cannot build this config: {err}") from None

    def tp_plan(self) -> dict[str, str]:
        """The model's own TP plan: its config's ``base_model_tp_plan`` (decoder layers, under ``model.``) and the
        causal LM class's ``_tp_plan`` (the head); empty when the config has none."""
        transformers = transformers_module()
        config = self.hf_config()
        base = dict(getattr(config, "base_model_tp_plan", None) or {})
        if not base:
            return {}
        cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
        return {**{f"model.{k}": v for k, v in base.items()}, **(getattr(cls, "_tp_plan", None) or {})}

    def num_params(self, active: bool = False) -> int:
        """Parameters of the model built on meta (tied weights once); ``active``: those one token uses (top_k
        of the routed experts)."""
        import torch

        with torch.device("meta"):
            model = build_hf_model(self, 1)
        total = sum(p.numel() for p in model.parameters())
        if not active or not self.is_moe:
            return total
        routed = sum(p.numel() for m in experts_modules(model) for p in m.parameters())
        return total - routed * (self.num_experts - self.top_k) // self.num_experts

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "config": dict(self.config),
            "attn_implementation": self.attn_implementation,
            "experts_implementation": self.experts_implementation,
        }

    def replace(self, **changes: Any) -> HFArgs:
        """Apply the job config's overrides: shape fields onto their config.json keys, the kernels as given."""
        config = dict(self.config)
        kernels = {
            k: changes.pop(k) for k in ("attn_implementation", "experts_implementation") if k in changes
        }
        for name, value in changes.items():
            keys = OVERRIDE_KEYS.get(name, ())
            key = next((k for k in keys if k in config), keys[0] if keys else None)
            if key is None or (name in ("num_experts", "top_k", "moe_ffn_dim") and key not in config):
                raise ValueError(
                    f"model.{name}={value} does not apply to {self.name!r} (no config.json field for it); "
                    "edit a copy of the config.json instead"
                )
            config[key] = value
        if "vocab_size" in changes:
            # Token ids past a cut vocabulary only make transformers warn; they size nothing.
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if isinstance(config.get(key), int) and config[key] >= config["vocab_size"]:
                    config[key] = None
        out = HFArgs(self.name, config, **{**self._kernels(), **kernels})
        check_fields(out)
        return out

    def _kernels(self) -> dict[str, Any]:
        return {
            "attn_implementation": self.attn_implementation,
            "experts_implementation": self.experts_implementation,
        }


def load_args(name: str) -> HFArgs:
    """The :class:`HFArgs` of ``hf:NAME`` as its config.json says."""
    return HFArgs(name, read_config(name))  # checked by replace(), once the job's overrides are on


def layout_problems(args: HFArgs, parallel: Any, fsdp_off: bool = False) -> list[str]:
    """Why the job's parallel layout cannot run this HF model (one line each): pipeline, context and expert
    parallel are not built, and TP needs the model's own tp plan, column/row-wise only, and FSDP2 (``fsdp_off``:
    the job applies none)."""
    p, out = parallel, []
    for degree in ("pp", "cp", "ep", "etp"):
        if getattr(p, degree) > 1:
            out.append(
                f"parallel.{degree}={getattr(p, degree)} is not supported for Hugging Face models ({args.name})"
            )
    if p.tp > 1:
        if not args.tp_plan():
            out.append(
                f"parallel.tp={p.tp}: {args.name} ({args.model_type}) has no base_model_tp_plan in its config class, "
                "so there is no TP plan to apply"
            )
        if fsdp_off:
            out.append(
                f"parallel.tp={p.tp} for Hugging Face models needs FSDP2 (dp > 1 or mixed precision): without it "
                "the norms stay plain tensors beside DTensor weights, which the optimizer cannot step together"
            )
        for flag in ("sequence_parallel", "loss_parallel"):
            if getattr(p, flag):
                out.append(
                    f"parallel.{flag}=True is not supported for Hugging Face models (their base_model_tp_plan is "
                    f"column/row-wise only): pass --no-{flag.replace('_', '-')}"
                )
    return out


def build_hf_model(args: HFArgs, max_seq_len: int) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` in the current default dtype (not the config's ``torch_dtype``), with
    the job's attention and experts kernels; ``max_seq_len`` is unused (HF computes RoPE per step)."""
    import torch

    transformers = transformers_module()
    kwargs: dict[str, Any] = {
        "attn_implementation": args.attn_implementation,
        "dtype": torch.get_default_dtype(),
    }
    if args.experts_implementation is not None:
        kwargs["experts_implementation"] = args.experts_implementation
    model = transformers.AutoModelForCausalLM.from_config(args.hf_config(), **kwargs)
    model.train()
    return model


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """HF's MoE expert collections (3-D ``gate_up_proj`` / ``down_proj`` weights and a ``num_experts``)."""
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "num_experts")]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of an HF causal LM (``model.model.layers``)."""
    return model.get_decoder().layers


def hf_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of an HF causal LM for ``tokens`` (no KV cache in training). On fake tokens the world answers
    transformers' packed-sequence check (:func:`hyperdryrun.compat.transformers.packed_sequence_patches`)."""
    return model(input_ids=tokens, use_cache=False).logits


def hf_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The model's own loss, as HF users train: ``model(input_ids=tokens, labels=labels).loss``, which runs the
    model's ``loss_function`` (causal LMs: transformers' ``ForCausalLMLoss``: the logits upcast to fp32, the
    labels padded with -100 and shifted by one, then ``cross_entropy`` with ``ignore_index=-100``)."""
    tokens, labels = batch
    return model(input_ids=tokens, labels=labels, use_cache=False).loss


def hf_pipeline_cut(model: nn.Module, layers: range, embedding: bool, head: bool) -> None:
    raise ValueError("parallel.pp > 1 is not supported for Hugging Face models")


def init_hf_weights(model: nn.Module) -> None:
    """Real values on this rank's local shards: weights ~ N(0, initializer_range), biases 0, norms 1, and the
    rotary inverse frequencies recomputed (``to_empty`` leaves buffers uninitialised)."""
    import torch

    with torch.no_grad():
        _init_hf_weights(model)


def _init_hf_weights(model: nn.Module) -> None:
    from hyperdryrun.models.llama import local_shard

    config = model.config
    std = getattr(config, "initializer_range", None) or 1.0 / math.sqrt(config.hidden_size)
    for name, p in model.named_parameters():
        local = local_shard(p)
        if "norm" in name:
            local.fill_(1.0)
        elif name.endswith("bias"):
            local.zero_()
        else:
            local.normal_(std=std)
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "rope_type"):
            init = module.compute_default_rope_parameters
            if module.rope_type != "default":
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                init = ROPE_INIT_FUNCTIONS[module.rope_type]
            inv_freq, _ = init(module.config)
            module.inv_freq.copy_(inv_freq)
            if hasattr(module, "original_inv_freq"):
                module.original_inv_freq.copy_(inv_freq)
