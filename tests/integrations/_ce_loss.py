"""A torchtitan override (``--override.imports tests.integrations._ce_loss.cross_entropy``): its plain
CrossEntropyLoss instead of the ChunkedLossWrapper around it, the loss the built-in recipe runs under pipelining."""

from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.config.override import override


@override(target=ChunkedLossWrapper.Config, description="the chunked loss's own cross entropy, unchunked")
def cross_entropy(config: ChunkedLossWrapper.Config) -> object:
    return config.loss_fn
