"""Where bodies over the inline limit wait between the client and the connector (decision 5).

Files `req_{id}` and `res_{id}` in one directory, as RelayServer's FileBodyStore, written and
read in `CHUNK` pieces so a body of any size costs one chunk of memory. Unlike RelayServer's
store it keeps track of what it wrote and sweeps: a file whose request is over and that nobody
removed (the client went away mid-download, a connector never fetched its body; RelayServer's
issue #271) is deleted once it is older than `max_age`, and files left by an earlier run are
deleted at startup once they are that old.

File I/O runs on the event loop: each call moves at most `CHUNK` bytes to or from the page
cache (tens of microseconds), cheaper than a thread hop per chunk.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import AsyncIterable, AsyncIterator, Collection
from pathlib import Path

from rmb_relay.clock import Clock, monotonic_clock, nanos
from rmb_relay.errors import ConfigError

__all__ = ["CHUNK", "FileBodyStore"]

#: bytes read from a body file per step
CHUNK = 256 * 1024
_NAME = re.compile(r"(req|res)_[0-9a-f-]{32,36}")


class FileBodyStore:
    """Body files in `directory`. `sweep(now)` removes tracked files older than `max_age`."""

    def __init__(
        self, directory: str | Path, *, max_age: float, clock: Clock = monotonic_clock
    ) -> None:
        self.directory = Path(directory)
        self.max_age = nanos(max_age)
        self.clock = clock
        #: file name -> when it was created (clock)
        self._files: dict[str, int] = {}
        #: bytes currently held in tracked files
        self.bytes = 0
        self._sizes: dict[str, int] = {}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / ".probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"body store {self.directory} is not writable: {err}") from None

    @staticmethod
    def name(kind: str, request_id: str) -> str:
        return f"{kind}_{request_id}"

    def path(self, name: str) -> Path:
        if not _NAME.fullmatch(name):
            raise ValueError(f"not a body file name: {name!r}")
        return self.directory / name

    def exists(self, name: str) -> bool:
        return name in self._files and self.path(name).exists()

    def size(self, name: str) -> int:
        return self._sizes.get(name, 0)

    async def write(self, name: str, chunks: AsyncIterable[bytes], first: bytes = b"") -> int:
        """Store `first` then every chunk; returns the size. A failed write leaves no file."""
        path = self.path(name)
        self._track(name, 0)
        written = 0
        try:
            with path.open("wb") as out:
                if first:
                    out.write(first)
                    written += len(first)
                async for chunk in chunks:
                    out.write(chunk)
                    written += len(chunk)
                    self._grow(name, written)
        except BaseException:
            self.remove(name)
            raise
        self._grow(name, written)
        return written

    async def read(self, name: str, *, remove: bool = False) -> AsyncIterator[bytes]:
        """The file's bytes in chunks; removed afterwards (also when the reader stops early)
        if `remove`."""
        try:
            with self.path(name).open("rb") as source:
                while chunk := source.read(CHUNK):
                    yield chunk
        finally:
            if remove:
                self.remove(name)

    def adopt(self, name: str, size: int) -> None:
        """Track a file another relay wrote into this (shared) directory, as if written here."""
        if name not in self._files:
            self._track(name, size)

    def release(self, name: str) -> None:
        """Stop tracking a file without deleting it: another relay took it over."""
        self._files.pop(name, None)
        self.bytes -= self._sizes.pop(name, 0)

    def remove(self, name: str) -> None:
        self._files.pop(name, None)
        self.bytes -= self._sizes.pop(name, 0)
        with contextlib.suppress(FileNotFoundError, ValueError):
            self.path(name).unlink()

    def _track(self, name: str, size: int) -> None:
        self._files[name] = self.clock()
        self._sizes[name] = size
        self.bytes += size

    def _grow(self, name: str, size: int) -> None:
        if name in self._sizes:
            self.bytes += size - self._sizes[name]
            self._sizes[name] = size

    def sweep(self, now: int | None = None, keep: Collection[str] = ()) -> int:
        """Remove tracked files older than `max_age`, except those in `keep` (still wanted);
        returns how many were removed."""
        now = self.clock() if now is None else now
        old = [
            name
            for name, created in self._files.items()
            if now - created > self.max_age and name not in keep
        ]
        for name in old:
            self.remove(name)
        return len(old)

    def sweep_leftovers(self, now_unix: float, max_age: float) -> int:
        """Files of earlier runs (not tracked) whose mtime is over `max_age` seconds old."""
        removed = 0
        for entry in os.scandir(self.directory):
            if not _NAME.fullmatch(entry.name) or entry.name in self._files:
                continue
            with contextlib.suppress(OSError):
                if now_unix - entry.stat().st_mtime > max_age:
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def count(self) -> int:
        return len(self._files)
