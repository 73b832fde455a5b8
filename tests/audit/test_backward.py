"""The reference's hand-walked backward issues the same ops and bytes as torch's autograd engine."""

from __future__ import annotations

from collections import Counter

from hyperdryrun import audit


def test_walking_the_autograd_graph_issues_the_same_backward_ops_as_the_engine():
    # The reference runs its backward by calling each node (the engine cannot run on fake cuda without a GPU);
    # on fake cpu both run, and every dispatched backward op (allocating or not) and every byte agree.
    engine = audit.record("cpu", "engine")["layers"]
    walk = audit.record("cpu", "walk")["layers"]
    for name in audit.LAYERS:
        assert audit.diff_layer(engine[name], walk[name]) == [], name
        ops = [
            Counter((op, tuple(new)) for op, new in r.get("backward", [])) for r in (engine[name], walk[name])
        ]
        assert ops[0] == ops[1], name
