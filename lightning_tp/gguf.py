"""``python -m lightning_tp.gguf``: convert a GGUF file into a Transformers directory. The code lives in
:mod:`lightning_tp.tools.gguf`; this module keeps the command (and ``from lightning_tp.gguf import ...``) where users
find it."""

import sys

from lightning_tp.tools.gguf import *  # noqa: F403  (the public names, as before the move)
from lightning_tp.tools.gguf import main

if __name__ == "__main__":
    sys.exit(main())
