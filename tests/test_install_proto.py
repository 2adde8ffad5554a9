"""The committed protobuf classes (python/rmb_relay/_proto, what every install path ships) are
what proto/ generates: regenerated into a temporary directory with the same command as `make
proto`, they must be the same files. The protobuf version stamp protoc writes is left out of the
comparison: a newer grpcio-tools changes it, not the classes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "rmb_relay" / "_proto"
SOURCES = ["proto/types.proto", "proto/peer.proto"]
#: protoc's version stamps: the header comment and the runtime version check's arguments
STAMP = re.compile(
    r"^# Protobuf Python Version: .*$|_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)",
    re.MULTILINE | re.DOTALL,
)


def unstamped(text: str) -> str:
    return STAMP.sub("<version>", text)


def test_committed_classes_match_proto(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *SOURCES,
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    generated = sorted(p.name for p in tmp_path.iterdir())
    assert generated == ["peer_pb2.py", "peer_pb2.pyi", "types_pb2.py", "types_pb2.pyi"]
    for name in generated:
        committed = PACKAGE / name
        assert committed.exists(), f"{committed} missing: run `make proto` and commit it"
        assert unstamped(committed.read_text()) == unstamped((tmp_path / name).read_text()), (
            f"{committed} does not match proto/: run `make proto` and commit it"
        )


def test_committed_classes_are_in_git() -> None:
    """Not ignored: `pip install .` from a clone and the sdist take what git has."""
    listed = subprocess.run(
        ["git", "ls-files", "python/rmb_relay/_proto"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert {Path(p).name for p in listed} >= {"__init__.py", "types_pb2.py", "peer_pb2.py"}
