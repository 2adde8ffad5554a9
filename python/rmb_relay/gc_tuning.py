"""The cyclic garbage collector's settings for a serving relay.

CPython walks its youngest generation every 700 net allocations of container objects (tuples,
lists, instances...). A relay under load allocates a few per message that live until the
message is delivered: tens of milliseconds when it waits for a remote relay (federation), so
every young pass finds them still alive, promotes them, and older passes walk them again, and
every full pass also walks everything startup built (~60,000 objects: modules, classes, the
CLI's parsers). Measured with gc callbacks on a federating relay at ~50,000 msg/s, that was
13% of its CPU.

So, once the relay serves: what startup built is frozen out of the collector's sight
(`gc.freeze`, it lives as long as the process anyway), and the young generation is collected
every `YOUNG_THRESHOLD` net allocations instead of 700, by when the messages of that moment
are long gone (freed by reference counting, which the collector does not replace). Cyclic
garbage still gets collected, at most that many objects later (a few MB at worst).
"""

from __future__ import annotations

import gc

#: net container allocations between two young-generation passes (CPython's default: 700)
YOUNG_THRESHOLD = 50_000


def tune_for_serving() -> None:
    """Call once the relay is up (everything built at startup is then frozen)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
