"""Nothing waits silently: evaluation, prediction and generate with unequal work per data-parallel rank (issue 11,
defect 7), a timeout on every mesh group and rank-0 writes longer than it (fault matrix, causes (a) and (b)), and the
hang tripwire of the test launcher."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.inference import generate_kwargs, prompts, reference_losses, reference_outputs
from tests.helpers.launch import ROOT, _descendants, child_env, torchrun, workers

WORKER = Path(__file__).with_name("liveness_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One launch of 2 processes for every check below (a cold start costs more than the checks)."""
    out = tmp_path_factory.mktemp("liveness")
    workers(WORKER, 2, str(out))
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def test_every_mesh_group_gets_the_timeout(results: list[dict]) -> None:
    for result in results:
        timeouts = result["group_timeouts"]
        # Groups the mesh creates get the timeout asked for; axes over the whole world reuse the world group (whose
        # timeout Lightning set from the strategy's).
        assert {name: t for name, (t, _, world) in timeouts.items() if not world} == {
            "dp_replicate": 21,
            "cp": 21,
            "tp": 21,
        }
        assert {name for name, (_, size, world) in timeouts.items() if world and size == 2} == {"dp_shard", "dp"}


@pytest.mark.scenarios("2d", "group_timeouts")
def test_every_mesh_group_gets_the_timeout_2d(two_d_results: list[dict]) -> None:
    """dp_shard 2 x tp 2: every group of size 2 is a new one and must carry the strategy's timeout."""
    for result in two_d_results:
        timeouts = result["group_timeouts"]
        assert "crash" not in timeouts, timeouts
        assert timeouts == {
            "dp_replicate": (7.0, 1),
            "dp_shard": (7.0, 2),
            "cp": (7.0, 1),
            "tp": (7.0, 2),
            "dp": (7.0, 2),
            # cp 2 x tp 2: FSDP2's flattened dp_shard x cp axis is a new group of 2, with the timeout too.
            "dp_shard_cp": (7.0, 2),
        }


def test_rank0_write_longer_than_the_timeout_succeeds(results: list[dict]) -> None:
    for result in results:
        assert result["slow_write"]["ok"], result["slow_write"]
        assert result["slow_write"]["seconds"] >= 12  # longer than the world group's timeout (8 s)
        assert result["failed_write"] == "Writing failed on rank 0: OSError: [Errno 28] No space left on device"
    assert [r["other_writer"] for r in results] == [[], [1]]


def test_predict_generate_with_uneven_prompts_and_lengths(results: list[dict]) -> None:
    """3 prompts on 2 ranks (2 and 1), generations of 2 and 6 tokens: every output equals one process's generate."""
    kwargs = generate_kwargs()
    reference = reference_outputs(kwargs)
    lengths = {
        i: len(out) - p["input_ids"].shape[1]
        for i, (out, p) in enumerate(zip(reference.values(), prompts(), strict=True))
    }
    assert len(set(lengths.values())) > 1, lengths  # the case needs generations of different lengths
    for layout in ("fsdp2", "tp2"):
        for result in results:
            assert "crash" not in result[f"{layout}_predict"], result[f"{layout}_predict"]["crash"]
        outputs = [result[f"{layout}_predict"]["outputs"] for result in results]
        if layout == "fsdp2":  # Lightning's predict sampler: rank 0 prompts 0 and 2, rank 1 prompt 1
            assert [sorted(o) for o in outputs] == [[0, 2], [1]]
        merged = {i: out for o in outputs for i, out in o.items()}
        assert merged == reference, layout


@pytest.mark.parametrize("stage", ["validate", "fit_validate"])
def test_validation_with_uneven_batches(results: list[dict], stage: str) -> None:
    """Rank 0 validates 2 batches, rank 1 one, each with a generate of its own length; inside fit too, between steps."""
    reference = reference_losses()
    for layout in ("fsdp2", "tp2"):
        per_rank = [r[f"{layout}_{stage}"] for r in results]
        for result in per_rank:
            assert "crash" not in result, result["crash"]
        merged = {i: loss for r in per_rank for i, loss in r["losses"].items()}
        assert merged == pytest.approx(reference, abs=1e-5), layout
        if layout == "fsdp2":
            assert [sorted(r["losses"]) for r in per_rank] == [[0, 2], [1]]
        if stage == "fit_validate":
            assert [r[f"{layout}_{stage}_steps"] for r in results] == [2, 2]


@pytest.mark.parametrize("stage", ["predict", "validate"])
def test_sharded_evaluation_refuses_uneven_work_on_every_rank(results: list[dict], stage: str) -> None:
    """With the weights sharded (the default), 2 batches on rank 0 and 1 on rank 1 would leave rank 0 in an
    all-gather: refused before the loop, on both ranks, with the counts and the two fixes."""
    for result in results:
        refused = result[f"fsdp2_sharded_{stage}"].get("refused", "")
        loop = {"predict": "predict", "validate": "validation"}[stage]
        assert f"The {loop} loader gives the ranks [2, 1] batches" in refused, result[f"fsdp2_sharded_{stage}"]
        assert "use_distributed_sampler=True" in refused and 'eval_weights="gathered"' in refused


@pytest.mark.parametrize("name", ["fsdp2_sharded", "fsdp2_kept"])
def test_sharded_validation_holds_the_share_of_a_training_step(results: list[dict], name: str) -> None:
    """FSDP2 over 2 ranks: each validation batch starts with the rank holding half the parameters, as each training
    batch does (the whole model was held from the first validation step on, before the default became sharded), and
    the losses are one process's. Also with `reshard_after_forward=False`, whose layers FSDP2 keeps whole after a
    forward until the backward that evaluation never runs."""
    reference = reference_losses()
    for result in results:
        run = result[f"{name}_fit_validate_even"]
        assert "crash" not in run, run["crash"]
        assert run["losses"] == pytest.approx({i: reference[i] for i in (0, 1)}, abs=1e-5)
        train, validation = run["held"]["train"], run["held"]["validation"]
        assert len(train) == 2 and len(validation) == 4, run["held"]
        assert set(validation) == set(train) and max(train) < 0.6, run["held"]


def test_generate_in_training_step_with_different_lengths(results: list[dict]) -> None:
    """Sharded weights (FSDP2 over 2): rank 0 generates 2 tokens, rank 1 six; generate keeps the ranks in step."""
    reference = reference_outputs(generate_kwargs())
    for rank, result in enumerate(results):
        assert result["fsdp2_fit_validate_train_generated"] == {rank: reference[rank]}


def test_tripwire_prints_every_rank_stack_on_a_hang(tmp_path: Path) -> None:
    """A launch that outlives its timeout fails with each worker's stack (faulthandler), not a bare timeout."""
    script = tmp_path / "stuck.py"
    script.write_text("import time\n\ndef stuck_forever():\n    time.sleep(1000)\n\nstuck_forever()\n")
    start = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish") as err:
        torchrun(script, 2, timeout=10)  # time for torchrun to start two workers that import nothing, on a busy machine
    assert time.monotonic() - start < 90
    assert str(err.value).count("stuck_forever") == 2, str(err.value)[-3000:]
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(script).encode() in _cmdline(p)]
    assert not left, "the launcher left processes of the stuck launch running"


#: What a rank reports of its start: the environment torchrun documents for its workers, Lightning's detection and
#: rank, the process group's size, and how the script runs.
_START_REPORT = """
import json, os, sys
import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning_utilities.core.rank_zero import rank_zero_only

dist.init_process_group("gloo")
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
         "OMP_NUM_THREADS"]
report = {"env": {n: os.environ.get(n) for n in names}, "elastic": TorchElasticEnvironment.detect(),
          "rank_zero_only": rank_zero_only.rank, "world": dist.get_world_size(), "rank": dist.get_rank(),
          "argv": sys.argv[2:], "path0": sys.path[0], "main": __name__}
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
"""


def test_the_suites_launcher_starts_the_ranks_as_torchrun_does(tmp_path: Path) -> None:
    """tests/helpers/forkrun.py (the suite's workers' launcher) gives each rank what torchrun gives it; the first rank
    that fails ends the launch, the others stopped, with a non-zero status."""
    script = tmp_path / "start.py"
    script.write_text(_START_REPORT)
    reports = {}
    for launch in (torchrun, workers):
        out = tmp_path / launch.__name__
        out.mkdir()
        launch(script, 2, str(out), "an", "argument")
        reports[launch.__name__] = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["rank"] for r in reports["torchrun"]] == [r["rank_zero_only"] for r in reports["torchrun"]] == [0, 1]
    assert reports["workers"] == reports["torchrun"]
    failing = tmp_path / "failing.py"
    failing.write_text("import os, time\nif os.environ['RANK'] == '1':\n    raise SystemExit(3)\ntime.sleep(1000)\n")
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"failed \(3\)") as err:
        workers(failing, 2, timeout=60)
    assert time.monotonic() - start < 45
    assert "rank 1" in str(err.value)
    # The launcher told to stop (a CI job cancelled) ends its ranks: none is left waiting at the rendezvous.
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(1000)\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.forkrun", "2", str(sleeper)], env=child_env(), cwd=ROOT
    )
    deadline = time.monotonic() + 60
    while len(_descendants(launcher.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = _descendants(launcher.pid)
    assert len(ranks) == 2, ranks
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()], "the launcher left its ranks running"


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_a_process_group_created_by_the_user_is_left_to_the_user(results: list[dict]) -> None:
    """The strategy destroys the process groups at exit only when it created the world group itself."""
    assert [r["destroy_registered"] for r in results] == [False, False]
