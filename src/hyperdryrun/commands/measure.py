"""``hyperdryrun measure``: the job of ``hyperdryrun run`` executed for real on the CPU, reported in the same schema.

Same flags and ``--config`` as ``run`` (one table, :data:`hyperdryrun.commands.job.RUN_FLAGS`); the report lands at
the same paths with ``metadata.mode = "measured"``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyperdryrun.commands import EXIT_OK, EXIT_VERDICT, exit_code_of, fail
from hyperdryrun.commands.job import add_job_arguments, job_from_args, print_warnings
from hyperdryrun.commands.preflight import check_rank_outputs, job_inputs
from hyperdryrun.config import ConfigError

CPU_ONLY_NOTE = (
    "measured on the CPU with CPU allocator semantics; target_device={target} was not executed (compare with a "
    "dry run of --target-device cpu: a cuda dry run adds 512 B rounding and CUDA kernel choices)"
)


MEMINFO = Path("/proc/meminfo")
PROCESS_BYTES = 1 << 30
"""The interpreter, torch and the profiler's own records, beside the step's tensors."""


@dataclass(frozen=True)
class HostMemoryNeed:
    """An upper estimate of the host bytes a measured step holds at once, from the model's shape alone."""

    parameters: int
    gradients: int
    optimizer_states: int
    unsharded: int
    """FSDP2's all-gathered parameters and unsharded gradients of the layers being computed."""
    activations: int
    """Saved activations of every local layer of the micro batches in flight, and the loss's fp32 logits."""

    @property
    def total(self) -> int:
        return (
            self.parameters + self.gradients + self.optimizer_states + self.unsharded + self.activations
            + PROCESS_BYTES
        )  # fmt: skip


_BYTES = {"fp32": 4, "bf16": 2}


def host_memory_needed(cfg: Any) -> HostMemoryNeed:
    """What ``measure`` of ``cfg`` needs on this machine: this rank's shard of the parameters, their gradients and
    optimizer states at ``training.dtype``, FSDP2's unsharded copies of two layers, and a bound on activations
    (per layer and token: 16 x dim + 6 x ffn_dim fp32 values without activation checkpointing, the layer input
    only with full checkpointing; three fp32 copies of the logits)."""
    m, p, t = cfg.model.args(), cfg.parallel, cfg.training
    stages = p.pp * p.pp_stages_per_rank
    local = m.num_params() // (p.tp * p.pp)
    shard = -(-local // (p.dp_shard * p.cp))
    store = _BYTES[t.dtype]
    states = {"AdamW": 2, "Adam": 2, "SGD": 1}[t.optimizer]
    layers = -(-m.n_layers // p.pp)
    layer = (m.num_params() - 2 * m.vocab_size * m.dim) // max(m.n_layers, 1)
    compute = _BYTES[t.param_dtype or t.dtype]
    unsharded = 2 * layer * (compute + _BYTES[t.reduce_dtype or t.dtype]) if p.dp_shard * p.cp > 1 else 0
    tokens = t.micro_batch_size * t.seq_len // p.cp
    in_flight = min(t.num_micro_batches, stages) if p.pp > 1 else 1
    full = (16 * m.dim + 6 * m.ffn_dim) * tokens * 4
    saved = layers * (m.dim * tokens * 4 if t.ac == "full" else full) + (full if t.ac == "full" else 0)
    logits = 3 * tokens * m.vocab_size * 4
    return HostMemoryNeed(
        parameters=shard * store,
        gradients=shard * store,
        optimizer_states=states * shard * store,
        unsharded=unsharded,
        activations=in_flight * saved + logits,
    )


def available_host_bytes(meminfo: Path | None = None) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes: what the kernel can give without swapping (None where the
    file or the field is missing, e.g. not Linux)."""
    try:
        text = (meminfo or MEMINFO).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            fields = rest.split()
            if fields and fields[0].isdigit():
                return int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return None


def host_memory_problem(cfg: Any, available: int | None) -> str | None:
    """The one-line refusal when the measured step would need more host memory than is available, else None."""
    if available is None:
        return None
    need = host_memory_needed(cfg)
    if need.total <= available:
        return None
    gib = 1 << 30
    return (
        f"measure of {cfg.model.name} needs about {need.total / gib:.1f} GiB of host memory (parameters "
        f"{need.parameters / gib:.1f}, gradients {need.gradients / gib:.1f}, optimizer states "
        f"{need.optimizer_states / gib:.1f}, unsharded layers {need.unsharded / gib:.1f}, activations up to "
        f"{need.activations / gib:.1f} GiB), this machine has {available / gib:.1f} GiB available "
        "(MemAvailable): cut the model down (--n-layers, --dim, --seq-len), or --no-memory-check to try anyway"
    )


def register(subparsers: Any) -> None:
    """Add the ``measure`` subcommand (the job flags of ``run``)."""
    p = subparsers.add_parser(
        "measure",
        help="run the same training step for real on the CPU and report its measured memory",
        description="Execute the job's step with real tensors on the CPU (a warm-up step, then one step under "
        "torch.profiler) and write the report in the dry run's schema. Only small models fit: use the small "
        "presets or --n-layers/--dim overrides. Compare with 'hyperdryrun run --target-device cpu'.",
    )
    add_job_arguments(p)
    p.add_argument("--no-stacks", action="store_true", help="do not record Python stacks in the blocks")
    p.add_argument("--quiet", action="store_true", help="print only the peak line")
    p.add_argument(
        "--no-memory-check",
        action="store_true",
        help="run even when the step's estimated host memory exceeds MemAvailable",
    )
    p.set_defaults(func=measure_command)


def _measure(cfg: Any, capture_stacks: bool = True) -> Any:
    from hyperdryrun.measure import measure_job

    trace = measure_job(cfg, capture_stacks=capture_stacks)
    if cfg.target_device != "cpu":
        trace.limitations.append(CPU_ONLY_NOTE.format(target=cfg.target_device))
    return trace


def measure_command(args: argparse.Namespace) -> int:
    """Exit 0 when measured (1 if over ``--device-memory-gib``), 2 on bad input, 3 if the run failed inside."""
    from rich.console import Console

    from hyperdryrun.report.console import print_summary, quiet_line
    from hyperdryrun.runner import run_rank

    warnings: list[str] = []
    try:
        cfg = job_from_args(args, warnings=warnings)
        check_rank_outputs(cfg.output_dir, [cfg.world.rank], inputs=job_inputs(args, cfg))
    except ConfigError as err:
        return fail(str(err), err, args.debug)
    print_warnings(warnings)
    from hyperdryrun.measure.step import unsupported

    why = unsupported(cfg) or (
        None if args.no_memory_check else host_memory_problem(cfg, available_host_bytes())
    )
    if why:
        return fail(why, None, args.debug)
    out = run_rank(cfg, capture_stacks=not args.no_stacks, execute=_measure, mode="measured")
    if out.error:
        return exit_code_of([out], args.debug)
    s = out.report["summary"]
    scratch = out.report["metadata"].get("kernel_scratch") or {}
    if args.quiet:
        Console().print(quiet_line(s, "measured peak"))
    else:
        print_summary(out.report, out.paths)
        if "peak_bytes_excluding" in scratch:
            Console().print(
                f"without kernel scratch (what a dry run counts): {scratch['peak_bytes_excluding']:,} B "
                f"(measured peak {s['peak_bytes']:,} B)"
            )
    return EXIT_VERDICT if out.oom else EXIT_OK
