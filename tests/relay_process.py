"""`python -m rmb_relay` as a real process for tests that need one of their own (a lowered
descriptor limit, a long fuzz run whose RSS must be the relay's alone): started on a free
port, its banner read for the port, its log read by a thread so a test can wait for a line
with a timeout and can tell whether anything was logged at ERROR or with a traceback."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

from tests.conftest import WAIT
from tests.processes import relay_env, stop_processes

#: what in a log line means the relay failed where it must not
PROBLEMS = (" ERROR ", " CRITICAL ", "Traceback")


class RelayProcess:
    """One relay process. `keep_log=False` keeps only problem lines in memory (a fuzz run logs
    a line per malformed input: millions), else every line, also on `lines` for waiting."""

    def __init__(
        self,
        *args: str,
        keep_log: bool = True,
        preexec_fn: Callable[[], None] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`env`: the process's environment (default: ours, with its data and state
        directories, the SQLite file and the tunnel's body store, in a new temp directory)."""
        if env is None:
            home = tempfile.mkdtemp(prefix="rmb-proc-")
            env = {**os.environ, "XDG_DATA_HOME": home, "XDG_STATE_HOME": home}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rmb_relay", "-l", "127.0.0.1:0", *args],
            env=relay_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=preexec_fn,
        )
        stdout, stderr = self.process.stdout, self.process.stderr
        assert stdout is not None
        assert stderr is not None
        banner = stdout.readline()
        if not banner.startswith("rmb-relay listening on "):
            self.process.kill()
            why = stderr.read()
            stop_processes([self.process])  # reaped, its pipes closed
            raise RuntimeError(f"relay did not start: {banner}{why}")
        self.address = ("127.0.0.1", int(banner.split()[3].rstrip(";").rsplit(":", 1)[1]))
        self.keep_log = keep_log
        self.log: list[str] = []
        self.problems: list[str] = []
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(stderr,), daemon=True)
        self._reader.start()

    @property
    def port(self) -> int:
        return self.address[1]

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if any(problem in line for problem in PROBLEMS):
                self.problems.append(line)
            if self.keep_log:
                self.log.append(line)
                self.lines.put(line)

    def wait_for_line(self, text: str) -> str:
        """The next log line containing `text` (fails the test after WAIT seconds of silence)."""
        while True:
            try:
                line = self.lines.get(timeout=WAIT)
            except queue.Empty:
                raise AssertionError(
                    f"no log line with {text!r}; log so far: {''.join(self.log)}"
                ) from None
            if text in line:
                return line

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) / 1024

    def stop(self) -> int:
        """SIGTERM and the exit code; killed (and the test failed) if it does not exit."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(WAIT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise

    def close(self) -> None:
        """Whatever state it is in: gone (SIGTERM, SIGKILL after the grace), its pipes closed
        once the log reader is done with them (for fixture teardown)."""
        stop_processes([self.process], close_pipes=False)
        self._reader.join(WAIT)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
