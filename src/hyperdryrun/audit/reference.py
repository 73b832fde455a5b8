"""The kernel audit's entry points: record the catalogue on a fake device, load a reference, compare against it.

A reference is :func:`record` run on fake "cuda" by a CUDA build of torch (``hyperdryrun audit-kernels --record
FILE``, no GPU needed); :func:`compare` records the simulation device (fake "cpu" with the target-kernel patches of
:mod:`hyperdryrun.world.kernels`) and diffs it against one, layer by layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from hyperdryrun.audit.backward import walk_backward
from hyperdryrun.audit.diff import judge_layer
from hyperdryrun.audit.layers import LAYERS
from hyperdryrun.audit.recorder import OpRecorder, saved_tensors
from hyperdryrun.compat.versions import torch_cuda_build, torch_version
from hyperdryrun.world import SimulatedWorld, default_simulation_device
from hyperdryrun.world.cuda_target import DEFAULT_CUDA_TARGET, cudnn_version_text, sm_text
from hyperdryrun.world.kernels import target_kernel_patches
from hyperdryrun.world.patches import PatchSet

SCHEMA_VERSION = 1


def run_layer(name: str, device: str, backward: str = "engine") -> dict[str, Any]:
    """Record one layer on fake ``device`` (inside a fake mode the caller entered): ops, allocations, saves."""
    torch.manual_seed(0)
    case = LAYERS[name](torch.device(device))
    rec = OpRecorder(torch.device(device).type)
    saved: list[list[Any]] = []
    if case.step is not None:
        rec.phase = "step"
        with rec:
            case.step()
    else:
        assert case.forward is not None
        with rec, saved_tensors(saved):
            out = case.forward()
        grad = torch.ones_like(out)
        rec.phase = "backward"
        with rec:
            if backward == "walk":
                walk_backward(out, grad)
            else:
                out.backward(grad)
        del out, grad
    result: dict[str, Any] = {"saved": saved}
    for phase, events in rec.events.items():
        result[phase] = [[op, sizes] for op, sizes in events]
    return result


@contextmanager
def simulation(device: str) -> Iterator[None]:
    """The fake world the audit runs in: the project's SimulatedWorld for fake "cpu"; a plain fake mode plus
    the same target-kernel patches on fake "cuda" (a CUDA build; the device mesh needs no GPU-free process group)."""
    with ExitStack() as stack:
        if device == "cpu":
            world = stack.enter_context(
                SimulatedWorld(world_size=1, target_device="cuda", simulation_device="cpu")
            )
            stack.enter_context(world.fake())
        else:
            # a one-rank fake process group for the layers on a device mesh (DTensor), torn down after the layer
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
            stack.callback(dist.destroy_process_group)
            stack.enter_context(PatchSet(target_kernel_patches("cuda", device)))
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        yield


def record(device: str, backward: str, names: list[str] | None = None) -> dict[str, Any]:
    """Run the catalogue (or ``names``) on fake ``device``; the result is what the reference fixture holds."""
    layers: dict[str, Any] = {}
    for name in names or list(LAYERS):
        try:
            with simulation(device):
                layers[name] = run_layer(name, device, backward)
        except Exception as err:  # a layer fake tensors cannot run here is recorded as such, not skipped
            layers[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    return {
        "schema_version": SCHEMA_VERSION,
        "torch_version": torch_version(),
        "cuda_build": torch_cuda_build(),
        "device": device,
        "backward": backward,
        "cuda_target": DEFAULT_CUDA_TARGET.as_dict(),
        # what this record did not observe but took from hyperdryrun.world.kernels (on fake "cuda" without a GPU:
        # the SDPA backend choice and the optimizer default); every other op ran as the device's own code
        "modelled": [f"{p.name}: {p.reason}" for p in target_kernel_patches("cuda", device)],
        "layers": layers,
    }


def compare(reference: dict[str, Any], names: list[str] | None = None) -> dict[str, list[str] | None]:
    """Run the catalogue on the simulation device and diff it against ``reference``: layer -> differences, or
    None for a layer the reference could not record (its ``error`` says why)."""
    device = default_simulation_device()
    names = names or [n for n in reference["layers"] if n in LAYERS]
    unknown = [n for n in names if n not in reference["layers"] or n not in LAYERS]
    if unknown:
        raise ValueError(f"layers not in both the reference and the catalogue: {', '.join(unknown)}")
    simulated = record(device, "engine", names)["layers"]
    return {
        name: None
        if "error" in reference["layers"][name]
        else judge_layer(name, reference["layers"][name], simulated[name])
        for name in names
    }


def load_reference(path: str) -> dict[str, Any]:
    """Read a reference record from ``path``, within the input limits of :mod:`hyperdryrun.ingest.files` (its size,
    ``HYPERDRYRUN_MAX_INPUT_BYTES``; its nesting): ValueError (not naming the path) when it is not one."""
    from pathlib import Path

    from hyperdryrun.ingest.files import IngestError, read_bytes, read_json

    try:
        data = read_json(Path(path), read_bytes(Path(path)))
    except IngestError as err:
        raise ValueError(err.problem) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"not a kernel-audit reference: the file holds a JSON {_json_kind(data)}, "
            "expected an object with schema_version and layers"
        )
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"schema_version={data.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    layers = data.get("layers")
    if not isinstance(layers, dict) or not all(isinstance(r, dict) for r in layers.values()):
        raise ValueError("layers: expected an object mapping each layer name to its record")
    return data


def describe_reference(reference: dict[str, Any]) -> str:
    """Where a reference was recorded, for people: ``torch 2.13.0+cu130, sm90, cuDNN 9.20``."""
    parts = [f"torch {reference.get('torch_version', '?')}"]
    target = reference.get("cuda_target")
    if isinstance(target, dict):
        sm, cudnn = target.get("sm"), target.get("cudnn")
        if isinstance(sm, list) and len(sm) == 2:
            parts.append(sm_text(sm))
        if isinstance(cudnn, int):
            parts.append(f"cuDNN {cudnn_version_text(cudnn)}")
    return ", ".join(parts)


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {list: "list", str: "string", type(None): "null"}.get(type(value), type(value).__name__)


__all__ = [
    "SCHEMA_VERSION",
    "compare",
    "describe_reference",
    "load_reference",
    "record",
    "run_layer",
    "simulation",
]
