"""Every GPU check in one call: ``python tests/gpu/run_all.py`` (a few minutes on one GPU).

In order, each in its own process, its JSON lines (each naming the device) passed through as they come:

1. ``check_blockwise_cuda.py``: context parallelism's kernels against attention in fp64 and SDPA, bf16 and fp32; the
   flash backward's arguments; host synchronisations in a split step; 32k tokens timed.
2. ``check_cuda.py``: a plain Trainer run's CUDA paths on one rank (bf16-mixed, resume, export, MFU).
3. ``multi_gpu.py``: its parity, resume and export checks on every visible GPU (one rank on one GPU, ``torchrun`` on
   more); ``--monitor`` adds its throughput check on a 0.2B Llama.

Each script gets ``--timeout`` seconds (a hang ends it and the next one runs); the last line sums up: the device,
each script's exit code and seconds. Exit code 1 if any failed. ``--cpu`` runs each script's CPU variant (checks the
scripts themselves; multi_gpu.py on one process), ``--skip NAME`` leaves a script out (``--skip multi_gpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPTS = ("check_blockwise_cuda", "check_cuda", "multi_gpu")


def command(name: str, args: argparse.Namespace, gpus: int) -> list[str]:
    script = str(HERE / f"{name}.py")
    flags = ["--cpu"] if args.cpu else []
    if name != "multi_gpu":
        return [sys.executable, script, *flags]
    flags += ["--out", str(args.out)] + ([] if args.monitor else ["--skip-monitor"])
    if args.cpu:
        flags += ["--only", "qwen3_sgd,resume_export"]
    if gpus > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={gpus}",
            script,
            *flags,
        ]
    return [sys.executable, script, *flags]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="each script's CPU variant (checks the scripts)")
    parser.add_argument("--skip", action="append", default=[], choices=SCRIPTS, help="a script to leave out")
    parser.add_argument("--monitor", action="store_true", help="multi_gpu.py's throughput check too (about a minute)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds each script may take")
    parser.add_argument("--out", type=Path, default=Path("/tmp/lightning_tp_gpu"))
    args = parser.parse_args()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: pass --cpu to run the scripts' CPU variants.")
    gpus = 0 if args.cpu else torch.cuda.device_count()
    device = "cpu" if args.cpu else f"{gpus} x {torch.cuda.get_device_name(0)}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    # The package's ranges are in pyproject.toml: a machine's own older releases show here first.
    versions = {name: installed(name) for name in ("torch", "transformers", "lightning", "peft")}
    print(json.dumps({"run_all": "start", "device": device, **versions}), flush=True)
    scripts = {}
    for name in SCRIPTS:
        if name in args.skip:
            continue
        started = time.perf_counter()
        try:
            code = subprocess.run(command(name, args, gpus), cwd=ROOT, env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        scripts[name] = {"exit_code": code, "seconds": round(time.perf_counter() - started, 1)}
        print(json.dumps({"run_all": name, "device": device, **scripts[name]}), flush=True)
    failed = [name for name, result in scripts.items() if result["exit_code"] != 0]
    print(json.dumps({"run_all": "summary", "device": device, "scripts": scripts, "failed": failed}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
