"""``python -m lightning_tp.inspect``: inspect a model's plan on the meta device. The code lives in
:mod:`lightning_tp.tools.inspect`; this module keeps the command (and ``from lightning_tp.inspect import ...``) where
users find it."""

import sys

from lightning_tp.tools.inspect import *  # noqa: F403  (the public names, as before the move)
from lightning_tp.tools.inspect import main

if __name__ == "__main__":
    sys.exit(main())
