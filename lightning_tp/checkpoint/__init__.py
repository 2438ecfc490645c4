"""What goes to and comes from storage: checkpoints that survive a crash and load on any layout, pretrained weights
read already sharded, and standard Hugging Face directories written from a sharded model.

- ``format``: file names and checkpoint keys; ``publish``: crash-safe writes that never remove what this package did
  not write; ``trust``: checkpoints are untrusted input (no arbitrary unpickling by default); ``validation``: clear
  errors before a load; ``rng_state``: random states saved and restored;
- ``state``: the whole training state saved and loaded (the strategies' ``save_checkpoint``/``load_checkpoint``);
  ``aliases``: one name for a tensor with several (tied weights); ``stage_files``: single files of pipelined models;
  ``dcp_layouts``: layouts DCP writes wrongly, saved plainly; ``readers``: checkpoints read one tensor at a time;
  ``remote``: fsspec URLs; ``safetensors``: the format written one tensor at a time;
- ``loading``: pretrained safetensors read as each rank's slices; ``hf_saves``: ``save_pretrained``, the adapter save
  and ``save_merged`` of a sharded model; ``stream``: the whole weights one tensor at a time, for an inference engine.

May import (checked by tests/unit/test_repo.py): ``compat``, ``composition``, ``patches``, ``layout``, ``state``,
``plans``, ``parallel``.
"""

__all__ = [
    "aliases",
    "dcp_layouts",
    "format",
    "hf_saves",
    "loading",
    "publish",
    "readers",
    "remote",
    "rng_state",
    "safetensors",
    "stage_files",
    "state",
    "stream",
    "trust",
    "validation",
]
