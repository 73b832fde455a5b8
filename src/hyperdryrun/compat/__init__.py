"""What depends on a library's version: one module per library and area, each decision naming the behaviour it
works around or models, the releases it applies to and where in that library's source it comes from.

Feature detection (``hasattr``, signatures) decides where it can; a version range where it cannot. The rest of the
package asks these modules and does not branch on versions itself.

- :mod:`~hyperdryrun.compat.versions`: the supported torch releases, the installed libraries' versions (no torch
  import, so the CLI refuses an unsupported torch before any work)
- :mod:`~hyperdryrun.compat.torch_dtensor`: DTensor's sharding propagation
- :mod:`~hyperdryrun.compat.torch_pipelining`: the pipeline schedules' metadata vote and a stage's receive buffers
- :mod:`~hyperdryrun.compat.torchtitan_moe`: torchtitan's MoE layers executed for real on the fake process group
  (the routing record, the EP count exchange)

docs/TORCH_VERSIONS.md lists what differs between the supported releases.
"""
