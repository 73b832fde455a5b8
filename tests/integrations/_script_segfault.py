"""A job whose step dies of a real segmentation fault in native code, as a custom extension reading a fake tensor's
data pointer would (run only through ``hyperdryrun script``, in its child process)."""

import ctypes

import torch
from torch import nn


def crash(model, optimizer, batches):
    ctypes.string_at(0)


def hyperdryrun_job(launch):
    return {
        "model_fn": lambda: nn.Linear(8, 8),
        "batch_fn": lambda i, d: torch.zeros(2, 8, device=d),
        "step_fn": crash,
    }
