"""A rotated recording (`record --rotate-mb MB` / `--rotate-s S`, like tcpdump's -C / -G): a directory of
numbered files, one recording read as one.

    OUTPUT/000001.rec, 000002.rec, ...   each a whole recording (mode 0600; the directory 0700)

The recorder moves to the next file when the current one reaches the size or the age. Connections open
at that moment are opened again in the next file (meta `continues`: {its flow id there: its flow id in
the previous file}) and their decoders go on where they were, so a call is stored whole, with its
messages, in the file where it completes: none is split or lost at a boundary. Every file carries the
same clock readings and `rotation: {set, index}`.

Reading a set as one: `inspect`, `replay`, `export` and `infer` take the directory (or a glob of its
files); `as_one(path)` merges the set (capture/merge.py, which joins each continued flow to the flow it
continues) into one temporary recording for the command and removes it when the process exits.
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from capture.errors import RecordingError
from capture.recording import RecordingWriter

_CARRIED = ("host", "kernel", "tool_version", "started_wall_ns", "started_mono_ns", "clock", "backend", "filters",
            "redaction_rules", "recorder_pid", "decode", "backend_settings")


def set_file(directory: str | os.PathLike[str], index: int) -> Path:
    return Path(directory) / f"{index:06d}.rec"


class Rotator:
    """When to move to the next file of a set, and that file's writer."""

    def __init__(self, directory: str | Path, rotate_bytes: int | None, rotate_s: float | None, overwrite: bool = False,
                 keep_s: float | None = None, keep_bytes: int | None = None) -> None:
        if not rotate_bytes and not rotate_s:
            raise RecordingError("rotation needs --rotate-mb or --rotate-s")
        self.directory = Path(directory)
        self.rotate_bytes = rotate_bytes
        self.rotate_s = rotate_s
        self.index = 1
        self.set_id = uuid.uuid4().hex[:12]
        self._started = time.monotonic()
        # a ring (capture/ring.py): closed files older than keep_s, or beyond keep_bytes in all, are deleted
        self.keep_s, self.keep_bytes = keep_s, keep_bytes
        self.closed: list[tuple[Path, float]] = []   # (file, when it was started), oldest first
        self.pinned = 0                              # a dump is reading the closed files: none is deleted
        self.lock = threading.Lock()
        if self.directory.exists() and not self.directory.is_dir():
            raise RecordingError(f"{self.directory} exists and is not a directory (a rotated recording is one)")
        if self.directory.is_dir() and any(self.directory.iterdir()):
            if not overwrite:
                raise RecordingError(f"{self.directory} is not empty (pass --force to replace its .rec files)")
            for old in self.directory.glob("[0-9][0-9][0-9][0-9][0-9][0-9].rec*"):
                old.unlink()
        try:
            self.directory.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise RecordingError(f"cannot create {self.directory}: {exc.strerror}") from exc

    @property
    def first(self) -> Path:
        return set_file(self.directory, 1)

    def meta(self) -> dict[str, Any]:
        return {"rotation": {"set": self.set_id, "index": self.index,
                             "rotate_bytes": self.rotate_bytes, "rotate_s": self.rotate_s}}

    def due(self, size: int) -> bool:
        return bool((self.rotate_bytes and size >= self.rotate_bytes)
                    or (self.rotate_s and time.monotonic() - self._started >= self.rotate_s))

    def next_writer(self, old: RecordingWriter) -> RecordingWriter:
        meta = {k: old.meta_value(k) for k in _CARRIED if old.meta_value(k) is not None}
        with self.lock:
            self.closed.append((set_file(self.directory, self.index), self._started))
            self.index += 1
            self._started = time.monotonic()
            self._prune()
        return RecordingWriter(set_file(self.directory, self.index), meta=meta | self.meta())

    def _prune(self) -> None:
        if self.pinned or (self.keep_s is None and self.keep_bytes is None):
            return
        now = time.monotonic()
        while self.closed and self.keep_s is not None and self.closed[0][1] < now - self.keep_s:
            _delete(self.closed.pop(0)[0])
        while self.keep_bytes is not None and len(self.closed) > 1 and \
                sum(_size(p) for p, _ in self.closed) > self.keep_bytes:
            _delete(self.closed.pop(0)[0])

    def window(self) -> list[Path]:
        """The closed files that started within the last keep_s (all of them without keep_s), pinned:
        `unpin()` when done reading them."""
        with self.lock:
            now = time.monotonic()
            self.pinned += 1
            return [p for p, at in self.closed if self.keep_s is None or at >= now - self.keep_s]

    def unpin(self) -> None:
        with self.lock:
            self.pinned -= 1
            self._prune()


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _delete(p: Path) -> None:
    for q in (p, p.with_name(p.name + "-wal"), p.with_name(p.name + "-shm")):
        q.unlink(missing_ok=True)


def set_files(path: str | os.PathLike[str]) -> list[str] | None:
    """The files of a rotated set named by a directory or a glob, in order; None when `path` is one file."""
    text = str(path)
    if os.path.isdir(text):
        files = sorted(glob.glob(os.path.join(glob.escape(text), "[0-9][0-9][0-9][0-9][0-9][0-9].rec")))
        if not files:
            raise RecordingError(f"{text}: a directory with no recording set in it (000001.rec, ...)")
        return files
    if any(ch in text for ch in "*?[") and not os.path.exists(text):
        # a glob only when it names files: a missing file whose name has a bracket is reported as missing
        return sorted(glob.glob(text)) or None
    return None


_made: list[str] = []


def _remove_made() -> None:
    for d in _made:
        shutil.rmtree(d, ignore_errors=True)


def as_one(path: str | os.PathLike[str], salvage: bool = False) -> str:
    """`path` itself when it is one recording; for a set (a directory or a glob), one temporary
    recording merging it (removed at exit)."""
    files = set_files(path)
    if files is None:
        return str(path)
    if len(files) == 1:
        return files[0]
    from capture.merge import merge_recordings

    tmp = tempfile.mkdtemp(prefix="shadowtest-set-")
    if not _made:
        atexit.register(_remove_made)
    _made.append(tmp)
    out = os.path.join(tmp, "set.rec")
    merge_recordings(files, out, allow_disjoint=True, salvage=salvage)
    return out
