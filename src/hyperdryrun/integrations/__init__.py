"""Training frameworks run as they are through :func:`hyperdryrun.simulate` (optional extras)."""
