"""Imported by a torchtitan ``--override.imports`` target in the crash-guard test: dies of a real segmentation
fault in native code, as a compiled kernel reading a fake tensor would. Never import it in the test process."""

import ctypes

ctypes.string_at(0)


def crash(config):  # the override target's function; never reached
    return config
