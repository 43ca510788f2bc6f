"""Files a command writes appear whole or not at all.

`export`, `redact` and `import` write into a temporary file beside the output (same directory, so the
final rename is atomic) and move it into place only when everything succeeded: a failure, a refusal or
Ctrl-C leaves no file behind, and never an empty one that `inspect` would call complete. Without
`overwrite` an existing output is never replaced, even by a file that appears while we write.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from capture.errors import CaptureError, RecordingError

_SIDE_FILES = ("-wal", "-shm", "-journal")   # SQLite's, beside a recording being written


def _remove(path: Path) -> None:
    for suffix in ("", *_SIDE_FILES):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


@contextmanager
def atomic_output(path: str | os.PathLike[str], *, overwrite: bool = False,
                  error: type[CaptureError] = RecordingError) -> Iterator[Path]:
    """Yield a temporary path (mode 0600, not yet created) beside `path`; on success it becomes `path`.

    Raises `error` when `path` exists and `overwrite` is false (before anything is written, and again
    if it appeared meanwhile) or when the directory cannot be written."""
    target = Path(path)
    if target.exists() and not overwrite:
        raise error(f"{target} already exists (pass --force to replace it)")
    try:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent or ".")
    except OSError as exc:
        raise error(f"cannot write {target}: {exc.strerror}") from exc
    os.close(fd)
    tmp = Path(name)
    tmp.unlink()            # the writers create it themselves (O_EXCL, mode 0600)
    try:
        yield tmp
        _publish(tmp, target, overwrite, error)
    finally:
        _remove(tmp)


def _publish(tmp: Path, target: Path, overwrite: bool, error: type[CaptureError]) -> None:
    if overwrite:
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)          # fails if `target` appeared meanwhile: never replaced
    except FileExistsError as exc:
        raise error(f"{target} already exists (pass --force to replace it)") from exc
    except OSError:                   # a filesystem without hard links: checked, then renamed
        if target.exists():
            raise error(f"{target} already exists (pass --force to replace it)") from None
        os.replace(tmp, target)
