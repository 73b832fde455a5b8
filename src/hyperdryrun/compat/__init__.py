"""What depends on a library's version: one module per library and area, each decision naming the behaviour it
works around or models, the releases it applies to and where in that library's source it comes from.

Feature detection (``hasattr``, signatures) decides where it can; a version range where it cannot. The rest of the
package asks these modules and does not branch on versions itself.

- :mod:`~hyperdryrun.compat.versions`: the supported torch releases, the installed libraries' versions (no torch
  import, so the CLI refuses an unsupported torch before any work); the one reader of ``torch.__version__``
- torch, by area: :mod:`~hyperdryrun.compat.torch_autocast`, :mod:`~hyperdryrun.compat.torch_compile`,
  :mod:`~hyperdryrun.compat.torch_context_parallel`, :mod:`~hyperdryrun.compat.torch_cublas`,
  :mod:`~hyperdryrun.compat.torch_dtensor`, :mod:`~hyperdryrun.compat.torch_flex`,
  :mod:`~hyperdryrun.compat.torch_fsdp`, :mod:`~hyperdryrun.compat.torch_kernels`,
  :mod:`~hyperdryrun.compat.torch_pipelining`, :mod:`~hyperdryrun.compat.torch_sdpa`,
  :mod:`~hyperdryrun.compat.torch_storage`, :mod:`~hyperdryrun.compat.torch_streams`
- :mod:`~hyperdryrun.compat.torchtitan_moe`: torchtitan's MoE layers executed for real on the fake process group
  (the routing record, the EP count exchange)
- :mod:`~hyperdryrun.compat.torchtitan` and :mod:`~hyperdryrun.compat.transformers`: those libraries' internals

Every ``Patch`` of a library object is built here; callers pass their own bookkeeping in as callbacks (this layer
imports only :mod:`hyperdryrun.patches` of the package). docs/TORCH_VERSIONS.md lists the modules and what differs
between the supported releases.
"""
