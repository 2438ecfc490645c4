"""What a newcomer relies on: the README's commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    ci_command = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")][-1]
    readme = (ROOT / "README.md").read_text()
    blocks = readme.split("```bash\n")[1:3]
    assert ci_command in blocks[1], "the README's second command must be the one .ci/run runs"
    assert "torch==2.13.0" in blocks[1].split("&&")[0]
    assert "examples/train_tp.py" in blocks[0]
