"""The checkpoint format's constants: file names and the keys this package adds to Lightning's checkpoint dict.
Every other module reads them from here."""

from __future__ import annotations

import re

#: Lightning's name for the file with everything that is not a model or optimizer tensor.
META_FILENAME = "meta.pt"


#: DCP's index of a checkpoint directory.
DCP_INDEX = ".metadata"


#: The entries this strategy adds to Lightning's checkpoint dict.
MODELS_KEY = "lightning_tp"


RNG_KEY = "lightning_tp_rng"


#: Lightning's key of the model's tensors in the checkpoint dict (a DCP directory's entries are ``state_dict.NAME``).
MODEL_KEY = "state_dict"


#: The files of a checkpoint directory: DCP's index (global or per rank, and the temporary name it is written under)
#: and shards, Lightning's ``META_FILENAME``. A directory holding only these (or nothing) is one this package may
#: replace or remove; anything else in it is someone else's. Also what a URL's data directory may hold (`remote`).
CHECKPOINT_FILE = re.compile(rf"(__\d+)?{re.escape(DCP_INDEX)}(\.tmp)?|{re.escape(META_FILENAME)}|__\d+_\d+\.distcp")
#: Written last into a checkpoint directory at a URL (``lightning_tp.checkpoint.remote``); without it the directory
#: is not a checkpoint.
COMMIT_MARKER = ".lightning_tp_complete"


def flat_optimizer_state(pp_size: int) -> bool:
    """Whether a checkpoint's optimizer state is written flat (``StateDictOptions(flatten_optimizer_state_dict=True)``:
    each parameter's hyperparameters under its own key): under pipeline parallelism, where the ranks hold different
    parameters and DCP keeps a non-tensor entry (the nested ``param_groups``) from one rank only. A checkpoint records
    its ``pp`` size in its layout (``layout_sizes``), so a load reads either form."""
    return pp_size > 1
