"""Subcommands beyond ``run``: each module exposes ``register(subparsers)``; the CLI wires them in."""
