"""What the kernel alone charges to deliver one message to a loopback TCP connection, when
consecutive messages go to different connections (issue 12's SEND, each routed to one of
10,000 clients) and when they go to few (RMB pairs, where writes coalesce):

    .venv/bin/python -m bench.loopback_floor [--connections 1,10,9000] [--messages 1000000]

Compiles `loopback_floor.c` with the system C compiler into a temporary directory and runs it
once per connection count: a writer thread writes `--size`-byte messages round-robin over the
connections, a reader thread reads them through epoll, no other work. The CPU each thread
spends per message is the floor under any relay's cost per delivered message on this machine
(and under its generator's receiving side), whatever language the relay is written in.
The last column is what that floor allows on this machine when the relay and its clients
share its cores: `os.cpu_count()` cores over writer + reader CPU per message, with no user-space
work at all (issue 12's BROADCAST goal is measured against it in docs/singyeong.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from .floor_build import compiled

SOURCE = Path(__file__).with_name("loopback_floor.c")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--connections", default="1,10,9000", help="comma-separated counts")
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=120, help="bytes per message")
    args = parser.parse_args()
    with compiled(SOURCE, "-lm") as exe:
        cores = os.cpu_count() or 1
        print(
            "connections  messages/s written  writer us/msg  reader us/msg  would block"
            f"  ceiling/s on {cores} cores"
        )
        for count in (int(text) for text in args.connections.split(",")):
            out = subprocess.run(
                [str(exe), str(count), str(args.messages), str(args.size)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            row = json.loads(out)
            ceiling = cores / (row["writer_us_per_msg"] + row["reader_us_per_msg"]) * 1e6
            print(
                f"{count:>11,}  {row['written_per_s']:>18,.0f}  {row['writer_us_per_msg']:>13.2f}"
                f"  {row['reader_us_per_msg']:>13.2f}  {row['would_block']:>11,}  {ceiling:>20,.0f}"
            )


if __name__ == "__main__":
    main()
