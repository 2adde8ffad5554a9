"""Request ids (dialects/tunnel/ids.py): canonical version-4 UUID text, never repeated."""

from __future__ import annotations

import uuid

from rmb_relay.dialects.tunnel.ids import request_id


def test_request_ids_are_canonical_version_4_uuids() -> None:
    for _ in range(1000):  # several batches of pooled randomness
        text = request_id()
        parsed = uuid.UUID(text)
        assert str(parsed) == text  # the form the body endpoints look jobs up by
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122


def test_request_ids_do_not_repeat_across_batches() -> None:
    ids = [request_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)


def test_the_variant_digit_takes_all_four_values() -> None:
    # the two random bits under the variant are kept (122 random bits, as uuid4)
    assert {request_id()[19] for _ in range(400)} == set("89ab")
