"""``python -m lightning_tp.inspect``: inspect a model's plan on the meta device. The code lives in
:mod:`lightning_tp.tools.inspect` (the report it prints: :mod:`lightning_tp.tools.inspect_report`); this module keeps
the command (and ``from lightning_tp.inspect import ...``) where users find it."""

import sys

from lightning_tp.tools.inspect import *  # noqa: F403  (the public names, as before the move)
from lightning_tp.tools.inspect import main
from lightning_tp.tools.inspect_report import *  # noqa: F403  (the report's public names, as before the split)

if __name__ == "__main__":
    sys.exit(main())
