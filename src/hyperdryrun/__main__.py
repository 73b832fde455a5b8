"""``python -m hyperdryrun``: the ``hyperdryrun`` command line."""

from hyperdryrun.cli import console_main

if __name__ == "__main__":
    console_main()
