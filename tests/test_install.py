"""Issue 34: every install path gives a working install, with no `make` involved: a wheel, an
sdist and `pip install .` from the clone, each into a fresh venv, run every entry point
(`rmb-relay`, `rmb-peer`, `rmb-load`, `rmb-analytics`), import the SDK and the envelope classes,
and `rmb-load` from that install drives a relay started from it.

Cost: one venv per install path; pip's cache (and the wheels directory pip is configured with)
serves the dependencies, and the Rust builds share the checkout's cargo target directory
(`CARGO_TARGET_DIR`, else `target/`), so only our crate is compiled again, and only for the sdist
(built in pip's temporary directory). Plain release builds, no profile (`make wheel` makes the
profile-guided wheel). Each test prints its time (`pytest -s`); docs/dropin.md has the figures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import WAIT
from tests.peer_fixtures import Output

ROOT = Path(__file__).resolve().parent.parent
#: building the core and installing the dependencies (pyspark is ~300 MB) on a loaded host
INSTALL_TIMEOUT = 1200
ENTRY_POINTS = ("rmb-relay", "rmb-peer", "rmb-load", "rmb-analytics")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(INSTALL_TIMEOUT + 300)]


def clean_env() -> dict[str, str]:
    """The environment of a user's shell: not this venv's, the build cache shared."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.setdefault("CARGO_TARGET_DIR", str(ROOT / "target"))
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != bin_dir)
    return env


def maturin() -> str:
    found = shutil.which("maturin", path=str(Path(sys.executable).parent))
    assert found is not None, "maturin is a dev dependency"
    return found


@contextmanager
def timed(what: str) -> Iterator[None]:
    start = time.monotonic()
    yield
    print(f"\n{what}: {time.monotonic() - start:.0f} s")


def fresh_venv(directory: Path, target: str) -> Path:
    """A new venv with `target` pip-installed (a path: wheel, sdist or source tree)."""
    venv.create(directory, with_pip=True)
    pip = directory / "bin" / "pip"
    subprocess.run(
        [pip, "install", "-q", target],
        check=True,
        env=clean_env(),
        timeout=INSTALL_TIMEOUT,
        cwd=directory,
    )
    return directory / "bin"


def run(bin_dir: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(bin_dir / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=cwd,
        timeout=120,
    )
    assert done.returncode == 0, f"{argv}: {done.stderr[-3000:]}"
    return done


def check_install(bin_dir: Path, work: Path) -> None:
    """Every entry point, the SDK and the shipped data, then a load run through a relay."""
    for command in ENTRY_POINTS:
        assert f"usage: {command}" in run(bin_dir, command, "--help", cwd=work).stdout
    assert "--master" in run(bin_dir, "rmb-analytics", "--help", cwd=work).stdout
    for dialect in ("rmb", "sbd", "singyeong", "tunnel", "peer"):  # every generator (load.md)
        assert "--samples" in run(bin_dir, "rmb-load", dialect, "--help", cwd=work).stdout
    assert run(bin_dir, "rmb-peer", "--version", cwd=work).stdout.startswith("rmb-peer ")
    imports = (
        "import rmb_relay, rmb_relay._core, rmb_relay._proto.types_pb2, rmb_relay.peer.gateway;"
        "from rmb_relay.sdk import RmbClient, RmbPeerClient;"
        "from rmb_relay.twins.chain import ChainCodec;"
        "print(rmb_relay.__file__, ChainCodec.load().spec_version)"
    )
    where, spec = run(bin_dir, "python", "-c", imports, cwd=work).stdout.split()
    assert Path(where).is_relative_to(bin_dir.parent), where  # the install, not the checkout
    assert int(spec) > 0
    drive_a_relay(bin_dir, work)


def drive_a_relay(bin_dir: Path, work: Path) -> None:
    """`rmb-relay` and `rmb-load` of this install: 200 messages per pair, none lost."""
    twins = f"sqlite:{work / 'twins.sqlite3'}"
    relay = subprocess.Popen(
        [str(bin_dir / "rmb-relay"), "-l", "127.0.0.1:0", "--twins", twins],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**clean_env(), "PYTHONUNBUFFERED": "1"},
        cwd=work,
    )
    output = Output(relay.stdout)
    try:
        output.wait_for("rmb-relay listening on ")
        banner = next(line for line in output.lines if "listening on" in line)
        port = banner.split("listening on ", 1)[1].split()[0].rstrip(";").rpartition(":")[2]
        summary = work / "summary.json"
        run(
            bin_dir,
            "rmb-load",
            "rmb",
            "--url",
            f"ws://127.0.0.1:{port}/",
            "--twins",
            twins,
            "--pairs",
            "2",
            "--count",
            "200",
            "--warmup",
            "0",
            "--json",
            str(summary),
            "--quiet",
            cwd=work,
        )
        data = json.loads(summary.read_text())
        assert data["lost"] == 0, data
        assert data["delivered"] == 400, data
    finally:
        relay.terminate()
        assert relay.wait(WAIT) == 0
        output.join()
        if relay.stdout is not None:
            relay.stdout.close()


def test_wheel_installs_and_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    with timed("wheel: build, venv, install, checks"):
        dist = tmp_path / "dist"
        subprocess.run(
            [maturin(), "build", "--release", "-q", "-o", str(dist)],
            cwd=ROOT,
            check=True,
            env=clean_env(),
            timeout=INSTALL_TIMEOUT,
        )
        (wheel,) = dist.glob("rmb_relay-*.whl")
        check_install(fresh_venv(tmp_path / "venv", str(wheel)), tmp_path)


def test_sdist_installs_and_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    with timed("sdist: build, venv, install (compiles the core), checks"):
        dist = tmp_path / "dist"
        subprocess.run(
            [maturin(), "sdist", "-o", str(dist)],
            cwd=ROOT,
            check=True,
            env=clean_env(),
            capture_output=True,
            timeout=INSTALL_TIMEOUT,
        )
        (sdist,) = dist.glob("rmb_relay-*.tar.gz")
        check_install(fresh_venv(tmp_path / "venv", str(sdist)), tmp_path)


def test_pip_install_dot_from_the_clone_works(tmp_path: Path) -> None:
    """`pip install .` in the checkout (what a clone is); no `make proto` needed."""
    with timed("pip install .: venv, install, checks"):
        check_install(fresh_venv(tmp_path / "venv", str(ROOT)), tmp_path)
