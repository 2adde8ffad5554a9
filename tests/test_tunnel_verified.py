"""The verified-token cache (verified.py) and its use by the token authority (tokens.py)."""

from __future__ import annotations

import pytest

from rmb_relay.clock import NS
from rmb_relay.dialects.tunnel.tokens import LEEWAY, TokenAuthority
from rmb_relay.dialects.tunnel.verified import VerifiedTokens
from rmb_relay.errors import AuthError


class WallClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000 * NS

    def __call__(self) -> int:
        return self.now


def test_an_entry_is_good_up_to_its_end_and_then_dropped() -> None:
    cache = VerifiedTokens(4)
    cache.put("t", "acme", 100)
    assert cache.get("t", 100) == "acme"
    assert cache.get("t", 101) is None
    assert len(cache) == 0
    assert cache.get("unknown", 0) is None


def test_the_least_recently_used_token_leaves_first() -> None:
    cache = VerifiedTokens(2)
    cache.put("a", "A", 100)
    cache.put("b", "B", 100)
    assert cache.get("a", 0) == "A"  # now b is the least recently used
    cache.put("c", "C", 100)
    assert len(cache) == 2
    assert cache.get("b", 0) is None
    assert (cache.get("a", 0), cache.get("c", 0)) == ("A", "C")
    with pytest.raises(ValueError, match="at least one"):
        VerifiedTokens(0)


async def test_the_authority_remembers_good_tokens_only_and_stays_bounded() -> None:
    clock = WallClock()
    tokens = TokenAuthority(b"k" * 32, ttl=60, clock=clock, cache=3)
    issued = [tokens.issue(f"t{n}") for n in range(10)]
    for n, token in enumerate(issued):
        assert tokens.known(token) is None
        assert await tokens.verify(token) == f"t{n}"
        assert tokens.known(token) == f"t{n}"
        assert len(tokens.verified) <= 3
    assert [tokens.known(token) for token in issued[-3:]] == ["t7", "t8", "t9"]
    assert tokens.known(issued[0]) is None  # evicted: verified again in full when it returns
    assert await tokens.verify(issued[0]) == "t0"
    forged = TokenAuthority(b"x" * 32, clock=clock).issue("t1")
    with pytest.raises(AuthError, match="refused"):
        await tokens.verify(forged)
    assert tokens.known(forged) is None
    # the cached verdict ends where a full check's would: exp + leeway
    clock.now += (60 + LEEWAY) * NS
    assert tokens.known(issued[9]) == "t9"
    clock.now += 1 * NS
    assert tokens.known(issued[9]) is None
    with pytest.raises(AuthError, match="expired"):
        await tokens.verify(issued[9])
