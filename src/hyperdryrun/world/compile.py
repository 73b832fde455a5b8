"""Compiled code in a simulated world: torch.compile's own machinery, no compiled kernel ever runs on fake data.

Inductor and Triton kernels read and write tensors' data pointers, which fake tensors do not have (a compiled
``create_block_mask`` on fake tensors dies in a segmentation fault). A region compiled with Inductor (the default
backend) is compiled as torch compiles it: dynamo traces it on the fake tensors, Inductor's ``compile_fx`` runs
AOTAutograd with Inductor's decompositions, joint-graph passes and partitioner (min-cut rematerialisation,
``torch._functorch.config.activation_memory_budget``, selective-AC policies), so the tensors saved for backward
are the partitioner's; in place of lowering and kernel compilation, the partitioned forward and backward graphs
(after Inductor's post-grad passes) are executed op by op on the fake tensors, each value freed after its last
use and the inputs released as a compiled graph releases them. Every op's output is allocated: Inductor's fusion
of pointwise chains into one kernel (no intermediate buffers) and its buffer reuse are not modelled, which a
limitation line says. Graph breaks run their eager code eagerly, as on the GPU.

Regions with another backend, and those torch has a fake path for (FlexAttention, modelled as its compiled CUDA
kernels by :mod:`hyperdryrun.compat.torch_flex`), run eagerly under torch's ``force_eager`` stance; the former
are named in a limitation line. Every cache entry dynamo made for a code object it had not compiled before is
dropped on exit.

It also registers, for the world's fake-mode subclass, the rule each higher-order operator has for
``FakeTensorMode`` (torch looks HOP rules up by the exact mode class), and undoes all of it on exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any

import torch
import torch.fx

from hyperdryrun.compat import torch_compile
from hyperdryrun.compat.torch_compile import TORCH_INTERNAL_REGIONS
from hyperdryrun.patches import Patch, PatchSet

MODELLED_REGIONS = {
    "torch.nn.attention.flex_attention.create_block_mask": "create_block_mask",
    "torch.nn.attention.flex_attention.flex_attention": "flex_attention",
}
"""Compiled functions (module.qualname) modelled as their CUDA kernels for a CUDA target (hyperdryrun.compat.torch_flex)."""


class CompileRefused(RuntimeError):
    """A compiled region asks for something the dry run does not model."""


def region_name(fn: Any) -> str:
    """``module.qualname`` of a compiled function; ``<Class> module`` for a compiled module (``nn.Module.compile``
    compiles its bound ``_call_impl``, ``torch.compile(module)`` its ``forward``)."""
    owner = getattr(fn, "__self__", fn)
    if isinstance(owner, torch.nn.Module):
        return f"{type(owner).__name__} module"
    target = getattr(fn, "__func__", fn)
    module = getattr(target, "__module__", None) or "?"
    return f"{module}.{getattr(target, '__qualname__', type(target).__name__)}"


@dataclasses.dataclass
class RegionGraphs:
    """What compiling one region made: its graphs and, for its training graphs, the bytes saved for backward by
    the joint graph with no recomputation and by Inductor's partitioner, and the ops the backward recomputes."""

    graphs: int = 0
    inference_graphs: int = 0
    eager_saved: int = 0
    compiled_saved: int = 0
    recomputed: Counter = dataclasses.field(default_factory=Counter)
    unlowered: list[str] = dataclasses.field(default_factory=list)
    """Why graphs of this region could not be lowered by Inductor here (they ran op by op)."""


def storage_bytes(values: list[Any], inputs: list[Any] = ()) -> int:
    """Bytes of the distinct storages behind ``values`` (fake tensors; views share their base's storage), those
    of ``inputs`` left out (a saved view of a graph input costs nothing)."""
    skip = {id(v.untyped_storage()) for v in inputs if isinstance(v, torch.Tensor)}
    seen: dict[int, int] = {}
    for v in values:
        if isinstance(v, torch.Tensor) and id(v.untyped_storage()) not in skip:
            storage = v.untyped_storage()
            seen[id(storage)] = _concrete(storage.nbytes())
    return sum(seen.values())


def _concrete(n: int | torch.SymInt) -> int:
    """``n`` as an int: a traced graph with dynamic shapes has symbolic sizes, whose hint is this call's value
    (``int()`` on a backed symbol would add a guard to the graph)."""
    if isinstance(n, torch.SymInt):
        hint = n.node.hint
        return int(hint) if hint is not None else int(n)
    return int(n)


class GraphRun(torch.fx.Interpreter):
    """Runs a partitioned graph op by op on the fake tensors as a compiled graph runs: it takes its inputs from
    the boxed argument list and clears it (a compiled graph releases its inputs), and drops every value after its
    last use (``garbage_collect_values``)."""

    def __init__(self, gm: torch.fx.GraphModule, inputs: list[Any]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self._inputs = list(reversed(inputs))
        inputs.clear()

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._inputs.pop()

    def run_graph(self) -> Any:
        return self.run(enable_io_processing=False)


class CompiledCode:
    """Context: Inductor regions compiled by torch and their graphs executed on the fake tensors, other regions
    run eagerly, HOPs get the world's fake-mode rules, FlexAttention is modelled for a CUDA target. ``regions``
    counts the compiled regions entered, by name."""

    def __init__(
        self,
        target_device: str,
        simulation_device: str,
        mode_class: type,
        tracker: Callable[[], Any],
    ) -> None:
        self.target_device, self.simulation_device = target_device, simulation_device
        self.mode_class = mode_class
        self.tracker = tracker
        self.regions: dict[str, int] = {}
        self.eager_regions: set[str] = set()
        """Regions whose backend is not Inductor: they ran eagerly."""
        self.compiled: dict[str, RegionGraphs] = {}
        self.failed: dict[str, dict[str, None]] = {}
        """Regions with frames that could not be compiled on the fake tensors (they ran eagerly), and why."""
        self.lowered_flex: Counter = Counter()
        """flex_attention HOPs traced into compiled regions, lowered as Inductor's CUDA templates, by HOP name."""
        self.eager_flex_calls = 0
        """flex_attention calls not compiled by the user (on a GPU: the unfused path, modelled as compiled)."""
        self._wrapper_codes: set[CodeType] = set()
        self._compiling: list[str] = []
        self._new_codes: dict[CodeType, None] = {}
        """Code objects dynamo compiled here that it had no cache entries for before: forgotten on exit."""
        self._seen_codes: set[CodeType] = set()
        self._bw_regions: dict[str, str] = {}
        """A partitioned backward graph's code -> its region (AOTAutograd compiles backward at its first call)."""
        self._stack: contextlib.ExitStack | None = None
        self._inductor_entered = False

    @property
    def models_flex(self) -> bool:
        return self.target_device == "cuda"

    def __enter__(self) -> CompiledCode:
        import torch._dynamo.eval_frame as eval_frame

        stack = contextlib.ExitStack()
        self._stack = stack
        try:
            stack.callback(self._forget_codes)
            stack.enter_context(PatchSet(torch_compile.fresh_code_state_patches()))
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            stack.enter_context(PatchSet([self._recording_patch(eval_frame)]))
            stack.enter_context(_hop_rules(self.mode_class))
            if self.models_flex:
                from hyperdryrun.compat.torch_flex import flex_patches

                stack.enter_context(PatchSet(flex_patches(self)))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _inductor_ready(self) -> None:
        """The dry run's Inductor (:func:`~hyperdryrun.compat.torch_compile.inductor_patches`; for a CUDA target,
        the async-TP pass as a CUDA build runs it and Inductor's FlexAttention lowerings as their CUDA templates
        allocate), entered into the world's stack the
        first time an Inductor region is about to compile, and undone with the rest on exit. Not on entry:
        importing ``torch._inductor.compile_fx`` and its lowerings costs about 0.8 s CPU (with jinja2's templates),
        which a step with no compiled region, most steps, would pay for nothing. Entered as on the world's entry:
        no dispatch or torch-function mode active (the imports' module-level tensors are host tensors, not the
        step's), the tracker paused."""
        if self._inductor_entered or self._stack is None:
            return
        from torch.utils._python_dispatch import _disable_current_modes

        stack = self._stack
        tracker = self.tracker()
        try:
            with (
                tracker.paused() if tracker is not None else contextlib.nullcontext(),
                _disable_current_modes(),
                torch._C.DisableTorchFunction(),
            ):
                self._enter_inductor(stack)
        finally:
            self._inductor_entered = True

    def _enter_inductor(self, stack: contextlib.ExitStack) -> None:
        stack.enter_context(
            PatchSet(
                torch_compile.inductor_patches(
                    self._inner_compile, self._partitioned, lambda: bool(self._compiling)
                )
            )
        )
        if self.target_device == "cuda":
            stack.enter_context(PatchSet(torch_compile.async_tp_pass_patches()))
        if self.models_flex:
            from hyperdryrun.compat.torch_flex import cuda_flex_lowerings

            stack.enter_context(cuda_flex_lowerings(self.lowered_flex))

    def __exit__(self, *exc: Any) -> None:
        self._inductor_entered = False
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _forget_codes(self) -> None:
        for code in self._new_codes:
            torch_compile.forget_code(code)
        self._new_codes.clear()
        self._seen_codes.clear()

    # ------------------------------------------------------------------ which regions compile
    def _recording_patch(self, eval_frame: Any) -> Patch:
        def on_compiled_call(caller: FrameType, callback: Any) -> Any:
            # The caller is dynamo's compile wrapper; ``fn`` is the function it compiles (a free variable of the
            # wrapper in torch 2.13, present in its frame's locals).
            self._wrapper_codes.add(caller.f_code)
            name = region_name(caller.f_locals.get("fn"))
            if name in TORCH_INTERNAL_REGIONS:
                return None
            self.regions[name] = self.regions.get(name, 0) + 1
            if self.models_flex and name in MODELLED_REGIONS:
                return None
            backend = torch_compile.inductor_backend(callback)
            if backend is not None:
                self._inductor_ready()
            if not torch_compile.fake_mode_active():
                # real tensors (``hyperdryrun measure``): torch compiles and runs Inductor's kernels for real
                if backend is None:
                    return None
                return torch_compile.CompileCallback(
                    callback, lambda frame: self._compile(name, frame, dry=False)
                )
            if backend is None:
                self.eager_regions.add(name)
                return None
            if self.target_device == "cuda" and torch_compile.cudagraphs_requested(backend):
                raise CompileRefused(
                    f"torch.compile region {name} asks for CUDA graphs (mode='reduce-overhead' or "
                    "triton.cudagraphs), which the dry run does not model; compile it without them"
                )
            return torch_compile.CompileCallback(
                callback,
                lambda frame: self._compile(name, frame, dry=True),
                lambda frame, err: self._failed(name, frame, err),
            )

        return torch_compile.stance_recording_patch(eval_frame, on_compiled_call)

    @contextlib.contextmanager
    def _compile(self, name: str, frame: FrameType, dry: bool) -> Iterator[None]:
        """Around dynamo converting ``frame`` for region ``name``: the code remembered, to be forgotten on exit if
        it had no entries before; for a dry run also the tracker paused (tracing is no device work), no compile
        caches, and the dry run's inner compiler in Inductor's place."""
        code = frame.f_code
        if code not in self._seen_codes:
            self._seen_codes.add(code)
            if torch_compile.cache_entries(code) == 0:
                self._new_codes[code] = None
        if not dry:
            yield
            return
        tracker = self.tracker()
        self._compiling.append(name)
        try:
            with (
                tracker.paused() if tracker is not None else contextlib.nullcontext(),
                torch_compile.no_compile_caches(),
            ):
                yield
        finally:
            self._compiling.pop()

    def _failed(self, name: str, frame: FrameType, err: BaseException) -> None:
        """Dynamo or the dry run's compiler could not compile ``frame`` on the fake tensors: it runs eagerly."""
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:200]
        self.failed.setdefault(name, {})[f"{frame.f_code.co_qualname} ({reason})"] = None

    # ------------------------------------------------------------------ the dry run's Inductor
    def _region(self) -> RegionGraphs:
        name = self._compiling[-1] if self._compiling else "?"
        return self.compiled.setdefault(name, RegionGraphs())

    def _inner_compile(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        """Inductor's ``compile_fx_inner`` for a dry run: its post-grad passes, lowering, scheduling and wrapper
        codegen, no kernel compiled; each call executes the wrapper on the fake tensors (its buffers allocated,
        reused and freed where Inductor's are, its kernels doing nothing). A graph Inductor cannot lower here is
        executed op by op (a limitation line names it). A backward graph is compiled at its first call, inside the
        step: the tracker is paused for it as for the forward."""
        is_inference = bool(kwargs.get("is_inference", False))
        is_backward = bool(kwargs.get("is_backward", False))
        if is_backward:
            # compiled at its first call: the region its forward was compiled for (one per graph's placeholders)
            name = self._bw_regions.get(_signature(gm), "?")
        else:
            name = self._compiling[-1] if self._compiling else "?"
        region = self.compiled.setdefault(name, RegionGraphs())
        if is_inference:
            region.inference_graphs += 1
        elif not is_backward:
            region.graphs += 1
        tracker = self.tracker()
        with tracker.paused() if tracker is not None else contextlib.nullcontext():
            try:
                call = torch_compile.load_wrapper(
                    torch_compile.inductor_wrapper_source(gm, example_inputs, **kwargs),
                    self.simulation_device,
                )
            except Exception as err:  # noqa: BLE001 - any lowering failure: the graph still runs, op by op
                region.unlowered.append(
                    f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                )
                return torch_compile.graph_output_code(lambda inputs: GraphRun(gm, inputs).run_graph())
        return torch_compile.graph_output_code(call)

    def _partitioned(
        self,
        forward: tuple[set[str], list[Any], list[Any]],
        fw: torch.fx.GraphModule,
        bw: torch.fx.GraphModule,
    ) -> None:
        forward_names, eager_saved, joint_inputs = forward
        fw_inputs = [n.meta.get("val") for n in fw.graph.nodes if n.op == "placeholder"]
        saved = [
            n.meta.get("val")
            for n in bw.graph.nodes
            if n.op == "placeholder" and not n.name.startswith("tangents")
        ]
        region = self._region()
        self._bw_regions[_signature(bw)] = self._compiling[-1] if self._compiling else "?"
        region.eager_saved += storage_bytes(eager_saved, joint_inputs)
        region.compiled_saved += storage_bytes(saved, fw_inputs)
        for n in bw.graph.nodes:
            if n.op == "call_function" and n.name in forward_names:
                region.recomputed[_op_name(n.target)] += 1

    def called_compiled(self, frame: Any, code: CodeType) -> bool:
        """Whether the nearest frame running ``code`` above ``frame`` was called by a ``torch.compile`` wrapper
        (the function was compiled by the user, so on a GPU it would run as Inductor's kernels)."""
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        return frame is not None and frame.f_back is not None and frame.f_back.f_code in self._wrapper_codes

    @property
    def limitations(self) -> list[str]:
        out = []
        for name, region in sorted(self.compiled.items()):
            line = (
                f"torch.compile region {name}: compiled by torch (dynamo, AOTAutograd, Inductor's decompositions "
                f"and partitioner), {region.graphs} training graph(s)"
            )
            if region.inference_graphs:
                line += f", {region.inference_graphs} inference graph(s)"
            if region.graphs:
                recomputed = (
                    ", ".join(f"{op} x{n}" for op, n in sorted(region.recomputed.items())) or "nothing"
                )
                line += (
                    f"; saved for backward per call {region.compiled_saved / (1 << 20):,.2f} MiB "
                    f"({region.compiled_saved} B; {region.eager_saved} B with no recomputation); "
                    f"recomputed in backward: {recomputed}"
                )
            out.append(line)
        if self.compiled:
            out.append(
                "compiled graphs run as Inductor's generated wrapper with its kernels doing nothing: the buffers it "
                "allocates, reuses (donated inputs included) and frees are counted, fused kernels' intermediates are "
                "not; the plan is Inductor's C++ (CPU) backend's"
                + (
                    ", which a CUDA target's Triton backend follows but for what it schedules differently (split "
                    "reductions' partial-result buffers, template and autotuning choices), not modelled"
                    if self.target_device == "cuda"
                    else ""
                )
            )
        for name, region in sorted(self.compiled.items()):
            if region.unlowered:
                out.append(
                    f"torch.compile region {name}: {len(region.unlowered)} graph(s) Inductor could not lower on this "
                    f"host ran op by op, every op's output allocated ({region.unlowered[0]})"
                )
        for name, frames in sorted(self.failed.items()):
            out.append(
                f"torch.compile region {name} ran eagerly where it could not be compiled on the fake tensors: "
                f"{'; '.join(frames)}"
            )
        eager = sorted(
            name for name in self.eager_regions if not (self.models_flex and name in MODELLED_REGIONS)
        )
        if eager:
            out.append(
                "torch.compile regions with a backend other than Inductor ran eagerly on the fake tensors (no "
                f"compiled kernel is executed in a dry run): {', '.join(eager)}; their eager temporaries and saved "
                "tensors are counted"
            )
        modelled = sorted(
            {MODELLED_REGIONS[n] for n in self.regions if self.models_flex and n in MODELLED_REGIONS}
        )
        if modelled:
            out.append(
                f"compiled {' and '.join(modelled)} modelled as Inductor's CUDA kernels: their outputs and saved "
                "tensors (torch's fake implementations; the backward's fp32 delta), not the kernels' on-chip scratch"
            )
        if self.lowered_flex:
            out.append(
                "flex_attention inside compiled regions lowered as Inductor's CUDA Triton templates allocate "
                f"({self.lowered_flex['flex_attention']} forward, {self.lowered_flex['flex_attention_backward']} "
                "backward graph(s)): out, logsumexp and max_scores in the forward; Inductor's fp32 delta, then dq, dk "
                "and dv in the backward; not the kernels' on-chip scratch"
            )
        if self.eager_flex_calls:
            out.append(
                f"flex_attention ran without torch.compile in {self.eager_flex_calls} call(s): on a GPU that is the "
                "unfused path, which materialises the attention scores; counted as the compiled kernels"
            )
        return out


def _signature(gm: torch.fx.GraphModule) -> str:
    """A backward graph as partitioned and as compiled later (AOTAutograd may copy the module): its placeholders
    and nodes' names."""
    return ",".join(n.name for n in gm.graph.nodes)


def _op_name(target: Any) -> str:
    packet = getattr(target, "overloadpacket", None)
    return str(packet if packet is not None else getattr(target, "__name__", target))


@contextlib.contextmanager
def _hop_rules(mode_class: type) -> Iterator[None]:
    """Every higher-order operator's ``FakeTensorMode`` rule for ``mode_class``, HOPs passing through the value-rule
    mode (:class:`~hyperdryrun.world.values.ValueRuleMode`) to it (:func:`hyperdryrun.compat.torch_compile.hop_rules`)."""
    from hyperdryrun.world.values import ValueRuleMode

    with torch_compile.hop_rules(mode_class, ValueRuleMode):
        yield
