"""``python -m lightning_tp.composition PAGE...``: rewrite the pages' composition blocks from the table."""

import sys

from lightning_tp.composition import main

sys.exit(main(sys.argv[1:]))
