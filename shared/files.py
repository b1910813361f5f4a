"""Writing a file others must never see half-written or, for secrets, at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_file(path: Path, text: str, *, mode: int = 0o600, owner: int | None = None) -> None:
    """``text`` into ``path`` atomically (a temporary file beside it, then a rename), with
    ``mode`` (default: this user only) and, where given, ``owner`` as its uid and gid. The
    temporary file is created 0600, so a secret is never readable by others, not even while
    it is written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        if owner is not None:
            os.chown(tmp, owner, owner)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
