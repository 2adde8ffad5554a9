"""Gateway metrics (issue #12 point 9): clients by application, dispatches by type and outcome,
queue depth, unacked and dead letters, heartbeat closes, decode errors.

Label values are bounded: dispatch types and outcomes come from fixed sets (an unknown `t` is
counted as `other`), and applications beyond the `MAX_APP_LABELS` largest are summed as
`other`, since application ids come from clients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rmb_relay.dialects.singyeong.clients import ClientIndex
    from rmb_relay.dialects.singyeong.queues import Queues
    from rmb_relay.dialects.singyeong.redis_queues import RedisQueues
    from rmb_relay.telemetry.metrics import Registry

#: applications shown by name in `rmb_relay_sg_clients`; the rest are `other`
MAX_APP_LABELS = 50

DISPATCH_TYPES = frozenset(
    (
        "UPDATE_METADATA",
        "SEND",
        "BROADCAST",
        "QUERY_NODES",
        "QUEUE",
        "QUEUE_REQUEST",
        "QUEUE_REQUEST_CANCEL",
        "QUEUE_ACK",
    )
)


class HotCounters:
    """Bumped per frame: plain ints (see telemetry/metrics.py for why)."""

    __slots__ = ("dispatches", "frames_in", "frames_out")

    def __init__(self) -> None:
        self.frames_in = 0
        self.frames_out = 0
        #: (type, outcome) -> count
        self.dispatches: dict[tuple[str, str], int] = {}

    def dispatch(self, kind: object, outcome: str) -> None:
        key = (kind if isinstance(kind, str) and kind in DISPATCH_TYPES else "other", outcome)
        self.dispatches[key] = self.dispatches.get(key, 0) + 1

    def add(self, key: tuple[str, str]) -> None:
        """`dispatch` with a key made once (a known type and outcome): the queue frames, three
        per message, count without building and checking a key each."""
        dispatches = self.dispatches
        dispatches[key] = dispatches.get(key, 0) + 1


class SgMetrics:
    def __init__(
        self,
        registry: Registry,
        index: Callable[[], ClientIndex],
        queues: Callable[[], Queues | RedisQueues],
        fast: Callable[[], tuple[int, int, int, int]] | None = None,
        held: Callable[[], tuple[int, int, int]] | None = None,
    ) -> None:
        """`fast`: the counts of the fast path (SEND/BROADCAST answered inside the read,
        dialect.py `fast_counts`), read with the rest: (frames_in, sends, broadcasts,
        frames_out), all `delivered`. `held`: the gateway's (metadata bytes of its clients,
        bytes of its QUEUE target cache, bytes of its replicas of other instances' clients)."""
        self.hot = HotCounters()
        self.fast = fast
        sg = {"dialect": "singyeong"}
        registry.counter_of(
            "rmb_relay_messages_in_total",
            "Messages received from clients, by dialect",
            lambda: [((), self.frames_in())],
            const=sg,
        )
        registry.counter_of(
            "rmb_relay_messages_out_total",
            "Messages written to clients (RMB: incl. error envelopes and mailbox), by dialect",
            lambda: [((), self.frames_out())],
            const=sg,
        )
        registry.counter_of(
            "rmb_relay_sg_dispatches_total",
            "singyeong dispatches by type and outcome (delivered, no_route, dropped, invalid, ...)",
            lambda: list(self.dispatches().items()),
            ("type", "outcome"),
        )

        def clients_by_app() -> list[tuple[tuple[str, ...], float]]:
            sizes = sorted(
                ((len(members), app) for app, members in index().by_app.items()), reverse=True
            )
            out: list[tuple[tuple[str, ...], float]] = [
                ((app,), count) for count, app in sizes[:MAX_APP_LABELS]
            ]
            rest = sum(count for count, _ in sizes[MAX_APP_LABELS:])
            if rest:
                out.append((("other",), rest))
            return out

        registry.gauge(
            "rmb_relay_sg_clients",
            "Identified singyeong clients on this instance, by application",
            ("application",),
            read=clients_by_app,
        )
        registry.gauge(
            "rmb_relay_sessions",
            "Sessions a dialect holds (RMB: logged in; SBD: handshaking and ready)",
            read=lambda: [((), len(index()))],
            const=sg,
        )
        registry.gauge(
            "rmb_relay_sg_queue_messages",
            "singyeong queued messages by state (waiting, unacked, dead)",
            ("state",),
            read=lambda: list(
                zip((("waiting",), ("unacked",), ("dead",)), queues().depth(), strict=True)
            ),
        )
        registry.gauge(
            "rmb_relay_sg_queue_bytes",
            "Bytes the in-memory singyeong queues hold (all: every state, bounded by "
            "--sg-queue-total-bytes; dead: of them in dead letters, by --sg-dead-letter-bytes)",
            ("state",),
            read=lambda: list(zip((("all",), ("dead",)), queues().held_bytes(), strict=True)),
        )

        registry.counter_of(
            "rmb_relay_sg_queue_refused_total",
            "singyeong in-memory queue refusals by budget: key (--sg-queue-bytes) and total "
            "(--sg-queue-total-bytes) refuse a QUEUE (op 3 queue_full); dead_letters counts "
            "messages kept in their queue because the dead letters were full",
            lambda: [((limit,), n) for limit, n in queues().refusals().items()],
            ("limit",),
        )
        registry.counter_of(
            "rmb_relay_sg_queue_withdrawals_total",
            "singyeong QUEUEs whose store in Redis failed (it may still land), withdrawn before "
            "the producer was told, by verdict: withdrawn (op 3 queue unavailable: never "
            "stored), stored (QUEUE_CONFIRM), unknown (no verdict within "
            "--sg-queue-verdict-timeout: op 3 queue unknown); dropped: waiting messages the "
            "pump found withdrawn (never delivered)",
            lambda: [((verdict,), n) for verdict, n in queues().withdrawals().items()],
            ("verdict",),
        )
        registry.gauge(
            "rmb_relay_sg_queue_held_bytes",
            "Bytes of singyeong QUEUEs held in memory, unwritten, while the cluster knows "
            "Redis is down (bounded by --sg-queue-held-bytes; 0 without Redis)",
            read=lambda: [((), queues().held_stores()[0])],
        )
        registry.counter_of(
            "rmb_relay_sg_queue_held_total",
            "singyeong QUEUEs held while the cluster knew Redis was down, by outcome: written "
            "(once it was back; then confirmed or refused as any store), expired (still held "
            "at --sg-queue-verdict-timeout: op 3 queue unavailable, never written), refused "
            "(past --sg-queue-held-bytes: op 3 queue unavailable at once)",
            lambda: [((outcome,), n) for outcome, n in queues().held_stores()[1].items()],
            ("outcome",),
        )
        registry.counter_of(
            "rmb_relay_sg_queue_ack_retries_total",
            "singyeong QUEUE_ACKs tried again after a failed Redis call (until the delivery's "
            "--sg-ack-timeout: past it the message is delivered again)",
            lambda: [((), queues().ack_retries())],
        )
        self.refused = registry.counter(
            "rmb_relay_sg_refused_total",
            "singyeong frames refused by a bound (issue 33; docs/hardening.md): "
            "metadata_keys, metadata_bytes, metadata_total (op 3 metadata_full), id_length "
            "(identify: op 8), "
            "queues_per_app, queues_total (op 3 too_many_queues), requests_client, "
            "requests_total (outstanding QUEUE_REQUESTs), proxy_target (proxy 403), "
            "proxy_concurrency (proxy 503), query_results (op 3 too_many_results, HTTP 400), "
            "restricted_displaced (a restricted client closed "
            "for an authenticated one taking its id), dead_letters_page (a dead-letter "
            "listing cut at --sg-dead-letters-page), replica_keys, replica_bytes, "
            "replica_total (another instance's client not replicated here)",
            ("limit",),
        )
        registry.gauge(
            "rmb_relay_sg_queues",
            "singyeong queues that exist (bounded by --sg-queues-total; with Redis, as of the "
            "last sweep)",
            read=lambda: [((), queues().queue_count())],
        )
        if held is not None:
            registry.gauge(
                "rmb_relay_sg_held_bytes",
                "Bytes the singyeong gateway holds for clients besides queues: metadata (each "
                "client within --sg-metadata-bytes), target_cache (--sg-target-cache-bytes) "
                "and replicas (other instances' clients' metadata, --sg-replica-total-bytes)",
                ("what",),
                read=lambda: list(
                    zip((("metadata",), ("target_cache",), ("replicas",)), held(), strict=True)
                ),
            )
        closed = "rmb_relay_connections_closed_total"
        closed_help = "Connections the relay closed on its own initiative, by dialect and reason"
        self.heartbeat_closed = registry.counter(
            closed, closed_help, const={**sg, "reason": "heartbeat"}
        )
        self.queries_refused = registry.counter(
            "rmb_relay_sg_queries_refused_total",
            "singyeong queries refused for a bound (--sg-query-max-*), by the bound",
            ("limit",),
        )
        self.decode_errors = registry.counter(
            "rmb_relay_sg_decode_errors_total",
            "singyeong frames that could not be decoded, by encoding",
            ("encoding",),
        )

    def frames_in(self) -> int:
        """Frames received, Python's and the fast path's."""
        fast = self.fast
        return self.hot.frames_in + (fast()[0] if fast is not None else 0)

    def frames_out(self) -> int:
        """SEND, BROADCAST and QUEUE dispatches written to receivers, Python's and the fast
        path's (one per receiver)."""
        fast = self.fast
        return self.hot.frames_out + (fast()[3] if fast is not None else 0)

    def dispatches(self) -> dict[tuple[str, str], int]:
        """(type, outcome) -> count, Python's and the fast path's."""
        out = dict(self.hot.dispatches)
        if self.fast is not None:
            _, sends, broadcasts, _ = self.fast()
            for kind, n in (("SEND", sends), ("BROADCAST", broadcasts)):
                if n:
                    key = (kind, "delivered")
                    out[key] = out.get(key, 0) + n
        return out
