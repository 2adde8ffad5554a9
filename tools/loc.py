"""Line counts of the product code, the way issue 32 counts them.

Counted: non-blank lines of `python/` (without the generated protobuf classes in `_proto/`) and
of `rust/` (without `#[cfg(test)]` items: the unit-test modules). Groups: the tunnel (every file
whose path names it; its target request builder lives in rust/dialects/tunnel/connector.rs, the
response parser it shares with the websocket client in rust/codec/http.rs), 신경 (every file
whose path names singyeong or `sg_`), and the whole.

    python tools/loc.py            # the table
    python tools/loc.py --files    # every counted file with its count
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rust_lines(text: str) -> int:
    """Non-blank lines outside `#[cfg(test)]` items (the attribute, then the item's braces)."""
    count = 0
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == "#[cfg(test)]":
            depth = 0
            opened = False
            i += 1
            while i < len(lines):
                stripped = re.sub(r"//.*", "", lines[i])
                depth += stripped.count("{") - stripped.count("}")
                if "{" in stripped:
                    opened = True
                i += 1
                if opened and depth <= 0:
                    break
                if not opened and stripped.rstrip().endswith(";"):
                    break
            continue
        if line.strip():
            count += 1
        i += 1
    return count


def python_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip())


def counted_files() -> dict[str, int]:
    found: dict[str, int] = {}
    for path in sorted([*(ROOT / "python").rglob("*.py"), *(ROOT / "python").rglob("*.pyi")]):
        if "_proto" in path.parts:
            continue
        found[str(path.relative_to(ROOT))] = python_lines(path.read_text())
    for path in sorted((ROOT / "rust").rglob("*.rs")):
        found[str(path.relative_to(ROOT))] = rust_lines(path.read_text())
    return found


def group(name: str) -> str | None:
    if "tunnel" in name:
        return "tunnel"
    if "singyeong" in name or "/sg_" in name or "/sg/" in name:
        return "singyeong"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", action="store_true", help="list every counted file")
    args = parser.parse_args()
    files = counted_files()
    if args.files:
        for name, n in files.items():
            print(f"{n:7,d}  {name}")
    py = sum(n for name, n in files.items() if name.startswith("python/"))
    rs = sum(n for name, n in files.items() if name.startswith("rust/"))
    tunnel = sum(n for name, n in files.items() if group(name) == "tunnel")
    sg = sum(n for name, n in files.items() if group(name) == "singyeong")
    print(f"python {py:,d}  rust {rs:,d}  whole {py + rs:,d}  tunnel {tunnel:,d}  singyeong {sg:,d}")


if __name__ == "__main__":
    main()
