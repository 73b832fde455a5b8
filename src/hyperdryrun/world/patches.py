"""Re-export of :mod:`hyperdryrun.patches` (the reversible patches moved there so that ``trace/`` may use them)."""

from hyperdryrun.patches import Patch, PatchSet

__all__ = ["Patch", "PatchSet"]
