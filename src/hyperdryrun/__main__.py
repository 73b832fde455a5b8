"""``python -m hyperdryrun``: the ``hyperdryrun`` command line."""

from hyperdryrun.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
