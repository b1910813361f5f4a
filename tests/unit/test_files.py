"""shared.files.write_file: atomic, with the mode asked for, and no temporary file left."""

from __future__ import annotations

import stat
from pathlib import Path

from shared.files import write_file


def test_written_with_its_mode_replacing_what_was_there(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "secret"
    write_file(path, "one\n")
    assert path.read_text() == "one\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    write_file(path, "two\n", mode=0o644)
    assert path.read_text() == "two\n" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["secret"]
