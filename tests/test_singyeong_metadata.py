"""Metadata over sockets: validation errors per key, the update rate (decision 8), and every
type stored as sent."""

from __future__ import annotations

import pytest

from rmb_relay.dialects.singyeong.metadata import (
    KEY_BYTES,
    MAX_REPORTED_PROBLEMS,
    MetadataAccount,
    MetadataError,
    MetadataLimit,
    validate,
    value_bytes,
    version_key,
)
from tests.helpers import eventually
from tests.sg_fixtures import FakeClock, MakeGateway, make_gateway

__all__ = ["make_gateway"]


@pytest.mark.parametrize(
    ("kind", "good", "bad"),
    [
        ("string", "eu", 1),
        ("integer", 3, 3.0),
        ("integer", -7, True),
        ("float", 2.5, 2),
        ("version", "1.2.3-rc.1+b5", "1.2"),
        ("list", [1, "a"], "a"),
        ("boolean", False, 0),
        ("map", {"a": [1]}, [1]),
    ],
)
def test_every_type_accepts_its_values_and_refuses_others(
    kind: str, good: object, bad: object
) -> None:
    update = validate({"k": {"type": kind, "value": good}})
    assert update.values == {"k": good}
    assert update.types == {"k": kind}
    with pytest.raises(MetadataError) as caught:
        validate({"k": {"type": kind, "value": bad}})
    assert caught.value.errors == {"k": f"k: value fails validation for '{kind}'"}


def test_malformed_entries_are_named() -> None:
    with pytest.raises(MetadataError) as caught:
        validate({"a": 5, "b": {"type": "string"}, "": {"type": "string", "value": ""}})
    assert caught.value.errors == {
        "a": 'a: expected {"type": T, "value": V}',
        "b": 'b: expected {"type": T, "value": V}',
        "": ": keys must be 1 to 256 characters",
    }
    with pytest.raises(MetadataError):
        validate([1, 2])


def test_a_refusal_names_the_first_problems_and_counts_the_rest() -> None:
    """Issue 33: one bounded answer, whatever the number of bad keys or the length of what
    they name (a type name of 10,000 characters is quoted cut)."""
    bad = {f"k{i}": {"type": "t" * 10_000, "value": 1} for i in range(1000)}
    with pytest.raises(MetadataError) as caught:
        validate({**bad, 7: {"type": "string", "value": "x"}})
    errors = caught.value.errors
    assert len(errors) == MAX_REPORTED_PROBLEMS + 1
    assert errors["..."] == f"{1001 - MAX_REPORTED_PROBLEMS} more problems not listed"
    assert errors["k0"] == f"k0: type '{'t' * 64}...' doesn't exists"
    assert sum(len(k) + len(v) for k, v in errors.items()) < 2048


def test_the_account_counts_keys_and_bytes_replacing_what_a_key_held() -> None:
    account = MetadataAccount()
    big = validate({"a": {"type": "string", "value": "x" * 900}})
    # a key costs KEY_BYTES beyond its name and value (what the index holds for it)
    assert big.sizes == {"a": KEY_BYTES + 1 + value_bytes("x" * 900)} == {"a": KEY_BYTES + 917}
    limit = 2 * KEY_BYTES + 1000
    assert account.charge(big, max_keys=2, max_bytes=limit) == KEY_BYTES + 917
    # the same key again replaces its old size, a smaller value gives bytes back
    small = validate({"a": {"type": "integer", "value": 1}})
    assert account.charge(small, max_keys=2, max_bytes=limit) == 17 - 917
    with pytest.raises(MetadataLimit) as caught:
        account.charge(validate({"b": {"type": "string", "value": "y" * 1990}}), 2, limit)
    assert (caught.value.limit, caught.value.allowed) == ("bytes", limit)
    assert account.held == KEY_BYTES + 17  # a refused update takes nothing
    account.charge(validate({"b": {"type": "boolean", "value": True}}), 2, limit)
    with pytest.raises(MetadataLimit) as caught:
        account.charge(validate({"c": {"type": "boolean", "value": True}}), 2, limit)
    assert caught.value.limit == "keys"
    assert "--sg-metadata-keys" in str(caught.value)
    assert value_bytes({"k": [1, "ab", {"x": None}]}) == 16 * 8 + 1 + 2 + 1


def test_semver_precedence() -> None:
    ordered = [
        "1.0.0-alpha",
        "1.0.0-alpha.1",
        "1.0.0-alpha.beta",
        "1.0.0-beta",
        "1.0.0-beta.2",
        "1.0.0-beta.11",
        "1.0.0-rc.1",
        "1.0.0",
        "1.0.1",
        "1.10.0",
        "2.0.0",
    ]
    keys = [version_key(v) for v in ordered]
    assert keys == sorted(keys)  # type: ignore[type-var]
    assert len(set(keys)) == len(keys)
    assert version_key("1.0.0+build") == version_key("1.0.0")
    for bad in ("1.0", "01.0.0", "1.0.0-", "v1.0.0", 5):
        assert version_key(bad) is None


async def test_invalid_update_is_op3_with_every_key(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    client = await gateway.client("c")
    await client.dispatch(
        "UPDATE_METADATA",
        {"x": {"type": "float", "value": 1}, "encoding": {"type": "string", "value": "j"}},
    )
    frame = await client.expect(3)
    assert frame["d"] == {
        "error": "invalid metadata",
        "extra_info": {
            "x": "x: value fails validation for 'float'",
            "encoding": "encoding: forbidden metadata key",
        },
    }
    await client.send(5)
    await client.expect(6)


async def test_updates_are_applied_and_visible_to_queries(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    client = await gateway.client("c")
    await client.update(region=("string", "eu"), load=("float", 0.5), v=("version", "1.2.3"))
    index = gateway.dialect.index
    await eventually(lambda: index.get("app", "c").metadata.get("v") == "1.2.3")  # type: ignore[union-attr]
    stored = index.get("app", "c")
    assert stored is not None
    assert stored.metadata["region"] == "eu"
    assert stored.types["load"] == "float"
    assert stored.metadata["encoding"] == "json"


async def test_sixty_updates_in_one_second_are_all_applied_in_order(
    make_gateway: MakeGateway,
) -> None:
    """50/s with a one-second burst: 50 apply at once, the other 10 wait (merged, never
    dropped) until the rate allows, and the last write of each key wins."""
    gateway = await make_gateway(fake_clock=True, metadata_rate=50)
    clock = gateway.clock
    assert isinstance(clock, FakeClock)
    client = await gateway.client("c")
    for i in range(60):
        await client.update(**{f"k{i}": ("integer", i), "last": ("integer", i)})
    await client.send(5)
    await client.expect(6)  # every update has been read
    stored = gateway.dialect.index.get("app", "c")
    assert stored is not None
    assert stored.metadata["last"] == 49
    assert "k50" not in stored.metadata
    session = stored.session
    assert session.metadata_pending["last"] == 59
    clock.advance(0.02)  # one interval: room for one more (merged) update
    gateway.dialect.flush_metadata(clock())
    assert stored.metadata["last"] == 59
    assert all(stored.metadata[f"k{i}"] == i for i in range(60))
    assert not session.metadata_pending


async def test_rate_timer_applies_waiting_updates_on_its_own(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(metadata_rate=1)  # burst of one: the second must wait ~1 s
    client = await gateway.client("c")
    await client.update(a=("integer", 1))
    await client.update(a=("integer", 2), b=("integer", 2))
    stored = gateway.dialect.index.get("app", "c")
    assert stored is not None
    await eventually(lambda: stored.metadata.get("b") == 2)
    assert stored.metadata["a"] == 2
