"""``python -m lightning_rlvr`` = the ``lightning_rlvr`` command."""

from lightning_rlvr.cli import main

if __name__ == "__main__":
    main()
