"""``python -m lightning_tp.plan --model MODEL --gpus 64 --gpu-memory 80GiB --seq 8192``: which layouts fit, with
per-GPU memory and collectives, before renting the GPUs. The code lives in :mod:`lightning_tp.tools.plan` (the engine
in :mod:`lightning_tp.dryrun`); this module keeps the command where users find it."""

import sys

from lightning_tp.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
