"""``python -m lightning_tp.export``: export a checkpoint as a Transformers directory. The code lives in
:mod:`lightning_tp.tools.export`; this module keeps the command (and ``from lightning_tp.export import ...``) where
users find it."""

import sys

from lightning_tp.tools.export import *  # noqa: F403  (the public names, as before the move)
from lightning_tp.tools.export import main

if __name__ == "__main__":
    sys.exit(main())
