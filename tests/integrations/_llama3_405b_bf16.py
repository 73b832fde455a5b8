"""torchtitan 0.3.0's ``llama3_405b`` config without its float8 converter (``--module
tests.integrations._llama3_405b_bf16 --config llama3_405b_bf16``): torchtitan's Float8LinearConverter needs torchao
and an SM89+ GPU at config time; everything else (model, full AC, compile with async TP, chunked loss, batch 2 x
8192, TP 8) is torchtitan's own config function."""

from torchtitan.models.llama3 import config_registry as registry


def llama3_405b_bf16() -> object:
    """``registry.llama3_405b()`` with ``model_registry`` called without converters (bf16 linears)."""
    original = registry.model_registry

    def no_converters(flavor: str, converters: object = None, **kwargs: object) -> object:
        return original(flavor, **kwargs)

    registry.model_registry = no_converters
    try:
        return registry.llama3_405b()
    finally:
        registry.model_registry = original
