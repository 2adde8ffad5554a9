"""Every query operator on every metadata type, in both query forms (decisions 3 and 4), plus
the index, selectors and rendezvous hashing, without sockets: the matcher is pure."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rmb_relay.dialects.singyeong.clients import Client, ClientIndex
from rmb_relay.dialects.singyeong.query import QueryError, QueryLimits, parse

#: one client holding one key of every type
TYPES = {
    "s": ("string", "eu"),
    "i": ("integer", 5),
    "f": ("float", 2.5),
    "v": ("version", "1.4.2"),
    "l": ("list", [1, "a", [2, 3], {"k": "x"}]),
    "b": ("boolean", True),
    "m": ("map", {"a": {"b": [10, 20]}, "key2": "y", "7": "seven"}),
}


def make_client(client_id: str = "c", app: str = "app", **values: tuple[str, Any]) -> Client:
    client = Client(app, client_id, restricted=False, encoding="json", socket_ip="127.0.0.1")
    client.metadata["restricted"] = False
    for key, (kind, value) in (values or TYPES).items():
        client.metadata[key] = value
        client.types[key] = kind
    return client


def seed(path: str, op: str, value: Any) -> dict[str, Any]:
    return {"ops": [{path.lstrip("/") if path.count("/") == 1 else path: {op: value}}]}


def path_form(path: str, op: str, value: Any) -> dict[str, Any]:
    return {"ops": [{"path": path, "op": op, "to": {"value": value}}]}


#: (path, op, operand, expected) over the client of TYPES
CASES = [
    # strings
    ("/s", "$eq", "eu", True),
    ("/s", "$eq", "us", False),
    ("/s", "$ne", "us", True),
    ("/s", "$gt", "at", True),
    ("/s", "$lt", "at", False),
    ("/s", "$gte", "eu", True),
    ("/s", "$lte", "eu", True),
    ("/s", "$in", ["us", "eu"], True),
    ("/s", "$nin", ["eu"], False),
    ("/s", "$contains", "e", False),
    ("/s", "$ncontains", "e", False),
    # integers (1 == 1.0; no bool confusion)
    ("/i", "$eq", 5, True),
    ("/i", "$eq", 5.0, True),
    ("/i", "$ne", 5, False),
    ("/i", "$gt", 4, True),
    ("/i", "$gte", 5, True),
    ("/i", "$lt", 5, False),
    ("/i", "$lte", 5.5, True),
    ("/i", "$in", [1, 5], True),
    ("/i", "$nin", [1, 2], True),
    ("/i", "$contains", 5, False),
    # floats
    ("/f", "$eq", 2.5, True),
    ("/f", "$gt", 2, True),
    ("/f", "$lt", 3, True),
    ("/f", "$lte", 2.4, False),
    ("/f", "$in", [2.5], True),
    ("/f", "$ne", 2.5, False),
    # versions compare as semver, not as strings
    ("/v", "$eq", "1.4.2", True),
    ("/v", "$eq", "1.4.2+build", True),
    ("/v", "$gt", "1.10.0", False),
    ("/v", "$lt", "1.10.0", True),
    ("/v", "$gte", "1.4.2", True),
    ("/v", "$gt", "1.4.2-rc.1", True),
    ("/v", "$lte", "1.4.1", False),
    ("/v", "$in", ["1.4.2", "2.0.0"], True),
    ("/v", "$gt", "not-semver", False),
    ("/v", "$nin", ["1.4.2"], False),
    # lists: elements, indexes, nested lists
    ("/l", "$contains", "a", True),
    ("/l", "$contains", 1, True),
    ("/l", "$contains", "z", False),
    ("/l", "$ncontains", "z", True),
    ("/l", "$ncontains", "a", False),
    ("/l", "$contains", [2, 3], True),
    ("/l", "$eq", [1, "a", [2, 3], {"k": "x"}], True),
    ("/l/0", "$eq", 1, True),
    ("/l/1", "$eq", "a", True),
    ("/l/2/1", "$eq", 3, True),
    ("/l/3/k", "$eq", "x", True),
    ("/l/9", "$eq", 1, False),
    ("/l/9", "$ne", 1, True),
    ("/l/x", "$eq", 1, False),
    ("/l", "$gt", 1, False),
    # booleans are not numbers
    ("/b", "$eq", True, True),
    ("/b", "$eq", 1, False),
    ("/b", "$ne", False, True),
    ("/b", "$gt", False, False),
    ("/b", "$in", [True], True),
    ("/b", "$in", [1], False),
    # maps: nested paths, key membership, keys with digits
    ("/m/a/b/1", "$eq", 20, True),
    ("/m/a/b/0", "$lt", 11, True),
    ("/m/key2", "$eq", "y", True),
    ("/m/7", "$eq", "seven", True),
    ("/m", "$contains", "key2", True),
    ("/m", "$ncontains", "nope", True),
    ("/m", "$contains", 7, False),
    ("/m/a/b/2", "$eq", 1, False),
    ("/m/a/c", "$nin", [1], True),
    # missing keys match $ne and $nin only (MongoDB)
    ("/nope", "$eq", 1, False),
    ("/nope", "$ne", 1, True),
    ("/nope", "$gt", 1, False),
    ("/nope", "$lt", 1, False),
    ("/nope", "$in", [1], False),
    ("/nope", "$nin", [1], True),
    ("/nope", "$contains", 1, False),
    ("/nope", "$ncontains", 1, False),
    # type mismatches are false, never an error
    ("/s", "$gt", 1, False),
    ("/i", "$gt", "a", False),
    ("/i", "$eq", "5", False),
    ("/s", "$ne", 1, True),
    ("/f", "$lt", None, False),
    ("/m", "$gt", {}, False),
]


@pytest.mark.parametrize(("path", "op", "operand", "expected"), CASES)
@pytest.mark.parametrize("form", [seed, path_form])
def test_operator(form: Any, path: str, op: str, operand: Any, expected: bool) -> None:
    query = parse(form(path, op, operand))
    assert query.matches(make_client()) is expected


def test_seed_document_example() -> None:
    """The seed document's own query: several keys, a logical op inside one key."""
    query = parse(
        {
            "application": "app",
            "ops": [
                {"key": {"$eq": "value"}},
                {"key2": {"$ne": "value2"}},
                {"key3": {"$and": [{"$gt": 10}, {"$lt": 20}]}},
            ],
        }
    )
    yes = make_client(key=("string", "value"), key2=("string", "x"), key3=("integer", 15))
    no = make_client(key=("string", "value"), key2=("string", "x"), key3=("integer", 25))
    assert query.matches(yes)
    assert not query.matches(no)


def test_logical_operators_in_both_forms() -> None:
    client = make_client(a=("integer", 1), b=("integer", 2))
    cases = [
        ({"$or": [{"a": {"$eq": 9}}, {"b": {"$eq": 2}}]}, True),
        ({"$and": [{"a": {"$eq": 1}}, {"b": {"$eq": 3}}]}, False),
        ({"$nor": [{"a": {"$eq": 9}}, {"b": {"$eq": 9}}]}, True),
        (
            {
                "op": "$or",
                "with": [
                    {"path": "/a", "op": "$eq", "to": {"value": 9}},
                    {"path": "/b", "op": "$gt", "to": {"value": 1}},
                ],
            },
            True,
        ),
        ({"op": "$nor", "with": [{"path": "/a", "op": "$eq", "to": {"value": 1}}]}, False),
        ({"a": {"$or": [{"$eq": 0}, {"$eq": 1}]}}, True),
        ({"path": "/b", "op": "$gt", "to": {"path": "/a"}}, True),
        ({"path": "/b", "op": "$gt", "to": {"path": "/zz", "default": 5}}, False),
    ]
    for condition, expected in cases:
        assert parse({"ops": [condition]}).matches(client) is expected, condition


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ([], "a query must be an object"),
        ({"application": ["tag"]}, "application must be a string"),
        ({"ops": {"a": 1}}, "ops must be a list"),
        ({"ops": [{"a": {"$regex": "x"}}]}, "unknown operator '$regex'"),
        ({"ops": [{"a": {"$in": "x"}}]}, "$in takes a list"),
        ({"ops": [{"a": 5}]}, 'a: expected {"$op": value}'),
        ({"ops": [{"path": "a", "op": "$eq", "to": {"value": 1}}]}, "path must be"),
        ({"ops": [{"path": "/a", "op": "$eq"}]}, '$eq needs "to"'),
        ({"ops": [{"op": "$and", "with": []}]}, "$and takes a non-empty list"),
        ({"ops": [{"$xor": []}]}, "unknown operator '$xor'"),
        ({"selector": {"$median": "x"}}, "unknown selector '$median'"),
        ({"selector": {"$min": "a", "$max": "b"}}, "selector must be one of"),
        ({"ops": [5]}, "a condition must be a non-empty object"),
    ],
)
def test_invalid_queries_say_why(raw: Any, reason: str) -> None:
    with pytest.raises(QueryError) as caught:
        parse(raw)
    assert reason in str(caught.value)


def test_deep_nesting_is_refused() -> None:
    condition: dict[str, Any] = {"a": {"$eq": 1}}
    for _ in range(40):
        condition = {"$and": [condition]}
    with pytest.raises(QueryError, match="nested deeper"):
        parse({"ops": [condition]})


def test_flags_and_restricted_clients() -> None:
    query = parse({"restricted": "true", "droppable": True, "optional": "yes", "key": 5})
    assert (query.restricted, query.droppable, query.optional, query.key) == (
        True,
        True,
        False,
        "5",
    )
    restricted = make_client()
    restricted.restricted = True
    assert not parse({}).matches(restricted)
    assert parse({"restricted": True}).matches(restricted)


def test_index_narrows_candidates_and_agrees_with_a_scan() -> None:
    index = ClientIndex()
    clients = []
    for n in range(300):
        client = make_client(
            f"c{n}",
            f"app{n % 3}",
            region=("string", ["eu", "us", "ap"][n % 3]),
            load=("integer", n % 10),
            v=("version", f"1.{n % 4}.0"),
        )
        index.add(client)
        clients.append(client)
    queries = [
        {"application": "app1", "ops": [{"region": {"$eq": "us"}}]},
        {"ops": [{"load": {"$eq": 3.0}}]},
        {"ops": [{"load": {"$in": [1, 2]}}, {"region": {"$ne": "eu"}}]},
        {"ops": [{"v": {"$eq": "1.2.0"}}]},
        {"ops": [{"path": "/load", "op": "$eq", "to": {"value": 7}}]},
        {"application": "nobody"},
        {"ops": [{"region": {"$eq": "mars"}}]},
        {"ops": [{"load": {"$gte": 3}}, {"load": {"$lt": 5}}]},
        {"ops": [{"load": {"$gt": 3.5, "$lte": 8}}]},
        {"ops": [{"path": "/load", "op": "$lt", "to": {"value": 1}}]},
        {"ops": [{"load": {"$gt": 9}}]},
        {"ops": [{"load": {"$gt": 5}}, {"load": {"$lt": 2}}]},
        {"ops": [{"v": {"$gt": "1.1.0"}}]},
        {"ops": [{"$or": [{"load": {"$lt": 1}}, {"load": {"$gt": 8}}]}]},
    ]
    for raw in queries:
        query = parse(raw)
        expected = {c.client_id for c in clients if query.matches(c)}
        assert {c.client_id for c in index.match(query)} == expected, raw
    query = parse({"application": "app1", "ops": [{"load": {"$eq": 3}}]})
    assert index.candidate_count(query) == 30  # the load=3 bucket, not app1's 100
    query = parse({"ops": [{"load": {"$gte": 3}}, {"load": {"$lt": 5}}]})
    assert index.candidate_count(query) == 60  # the slice 3 <= load < 5, not all 300
    # metadata changes move clients between buckets
    index.set_values(clients[3], {"load": 4}, {})
    assert clients[3] not in index.match(parse({"ops": [{"load": {"$eq": 3}}]}))
    assert clients[3] in index.match(parse({"ops": [{"load": {"$eq": 4}}]}))
    assert clients[3] in index.match(parse({"ops": [{"load": {"$gt": 3.5, "$lt": 4.5}}]}))
    index.remove(clients[4])
    assert clients[4] not in index.match(parse({"ops": [{"load": {"$eq": 4}}]}))
    assert clients[4] not in index.match(parse({"ops": [{"load": {"$gte": 4}}]}))


#: values of one key across kinds that Python equality would mix up (1, 1.0, True), versions
#: equal by precedence ("1.0.0", "1.0.0+b"), strings that are not versions, NaN, a list (a
#: `version` value that is not semver is refused by metadata validation, so none here)
_KINDED_VALUES = st.sampled_from(
    [
        ("integer", 1),
        ("float", 1.0),
        ("integer", 0),
        ("boolean", True),
        ("boolean", False),
        ("string", "1.0.0"),
        ("string", "x"),
        ("version", "1.0.0"),
        ("version", "1.0.0+b"),
        ("version", "2.0.0"),
        ("float", float("nan")),
        ("list", [1]),
    ]
)
_EQ_VALUES = st.sampled_from([1, 1.0, 0, True, False, "1.0.0", "1.0.0+b", "x", "1.0", "2.0.0"])


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(_KINDED_VALUES, min_size=1, max_size=12),
    wanted=_EQ_VALUES,
    form=st.sampled_from(["seed", "path"]),
    with_app=st.booleans(),
)
def test_an_exact_eq_query_skips_its_predicate_and_agrees_with_a_scan(
    values: list[tuple[str, Any]], wanted: Any, form: str, with_app: bool
) -> None:
    """A lone top-level `$eq` is answered by the hash index alone (`Query.exact`): whatever
    the kinds of the clients' values, the index's answer is the predicate's."""
    index = ClientIndex()
    clients = []
    for n, (kind, value) in enumerate(values):
        client = make_client(f"c{n}", f"app{n % 2}", k=(kind, value))
        index.add(client)
        clients.append(client)
    raw = seed("k", "$eq", wanted) if form == "seed" else path_form("/k", "$eq", wanted)
    if with_app:
        raw["application"] = "app0"
    query = parse(raw)
    assert query.exact
    expected = {c.client_id for c in clients if query.matches(c)}
    assert {c.client_id for c in index.match(query)} == expected


def test_only_a_lone_eq_is_exact() -> None:
    assert parse(seed("k", "$eq", 1)).exact
    assert not parse({"ops": [{"k": {"$eq": 1}}, {"j": {"$eq": 2}}]}).exact
    assert not parse({"ops": [{"k": {"$eq": 1, "$ne": 2}}]}).exact
    assert not parse({"ops": [{"k": {"$eq": 1}, "j": {"$eq": 2}}]}).exact
    assert not parse(seed("k", "$in", [1])).exact
    assert not parse(seed("/k/a", "$eq", 1)).exact
    assert not parse({"ops": [{"$or": [{"k": {"$eq": 1}}]}]}).exact
    assert not parse({"ops": [{"path": "/k", "op": "$eq", "to": {"path": "/j"}}]}).exact
    assert not parse({"application": "a"}).exact


def test_selectors() -> None:
    index = ClientIndex()
    for v in (1, 4, 10, "x", None, True):
        index.add(make_client(f"c{v}", k=("any", v)))

    def pick(kind: str) -> list[str]:
        query = parse({"selector": {kind: "k"}})
        return [c.client_id for c in index.resolve(query, broadcast=False)]

    assert pick("$min") == ["c1"]
    assert pick("$max") == ["c10"]
    assert pick("$avg") == ["c4"]  # mean 5: 4 is nearest
    assert index.resolve(parse({"selector": {"$min": "zz"}}), broadcast=False) == []


def test_rendezvous_is_stable_and_moves_only_the_leavers_keys() -> None:
    def owners(clients: list[Client]) -> dict[str, str]:
        index = ClientIndex()
        for client in clients:
            index.add(client)
        picks = {}
        for key in keys:
            (chosen,) = index.resolve(parse({"key": key}), broadcast=False)
            picks[key] = chosen.client_id
        return picks

    keys = [f"user-{n}" for n in range(2000)]
    before = owners([make_client(f"c{n}") for n in range(10)])
    assert before == owners([make_client(f"c{n}") for n in reversed(range(10))])
    assert len(set(before.values())) == 10  # spread over every client
    after = owners([make_client(f"c{n}") for n in range(10) if n != 3])
    moved = [key for key in keys if before[key] != after[key]]
    assert moved
    assert all(before[key] == "c3" for key in moved)


def test_the_weight_is_blake2b_of_key_application_and_id() -> None:
    import hashlib

    index = ClientIndex()
    client = make_client("c\u00e9", "app")
    index.add(client)
    digest = hashlib.blake2b("k\0app\0c\u00e9".encode(), digest_size=8).digest()
    assert index.core.rendezvous_weight("k", client.handle) == int.from_bytes(digest, "big")


def test_query_bounds_are_flags_and_name_the_limit() -> None:
    tight = QueryLimits(max_depth=2, max_ops=3, max_list=4)
    with pytest.raises(QueryError, match="--sg-query-max-list") as caught:
        parse({"ops": [{"a": {"$in": [1, 2, 3, 4, 5]}}]}, tight)
    assert caught.value.limit == "list"
    with pytest.raises(QueryError, match="--sg-query-max-ops") as caught:
        parse({"ops": [{"a": {"$eq": n}} for n in range(4)]}, tight)
    assert caught.value.limit == "ops"
    with pytest.raises(QueryError) as caught:
        parse({"ops": [{"$or": [{"$and": [{"a": {"$eq": 1}}]}]}]}, tight)
    assert caught.value.limit == "depth"
    assert parse({"ops": [{"a": {"$nin": [1, 2, 3, 4]}}]}, tight).matches(make_client())
    with pytest.raises(QueryError) as caught:
        parse({"ops": 5})
    assert caught.value.limit is None
