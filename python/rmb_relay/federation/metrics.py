"""Federation's part of /metrics (docs/metrics.md). Everything is read at scrape time from the
plain counters the federation code keeps, so the per-message path pays no metric call."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rmb_relay.federation.inbound import InboundFederation
    from rmb_relay.federation.outbound import OutboundFederation
    from rmb_relay.telemetry.metrics import Registry


def register(
    registry: Registry, outbound: OutboundFederation, inbound: InboundFederation | None
) -> None:
    stats = outbound.stats
    ranker = outbound.ranker
    registry.counter_of(
        "rmb_relay_federation_out_total",
        "Envelopes for other relays, by outcome (accepted: a relay answered 202; rejected: "
        "4xx; expired; dropped: an answer that failed, or unreadable)",
        lambda: [
            (("accepted",), stats.accepted),
            (("rejected",), stats.rejected),
            (("expired",), stats.expired),
            (("dropped",), stats.dropped),
        ],
        ("outcome",),
    )
    registry.counter_of(
        "rmb_relay_federation_delivered_total",
        "Envelopes another relay accepted, by its domain (the first 1024 domains by name, the "
        "rest (other))",
        lambda: [((d,), n[0]) for d, n in stats.peers.items()],
        ("relay",),
    )
    registry.counter_of(
        "rmb_relay_federation_failed_total",
        "Rounds over a twin's relays that ended without delivery (every relay tried failed, "
        "or one refused for good), counted for each of the twin's relay domains",
        lambda: [((d,), n[2]) for d, n in stats.peers.items()],
        ("relay",),
    )
    registry.counter_of(
        "rmb_relay_federation_post_failures_total",
        "POSTs to other relays that failed (transport error, timeout, neither 202 nor 4xx)",
        lambda: [((), stats.failed_posts)],
    )
    registry.counter_of(
        "rmb_relay_federation_batches_total",
        "POSTs that carried a batch of envelopes to an rmb-relay that takes them",
        lambda: [((), outbound.sender.batches)],
    )
    registry.counter_of(
        "rmb_relay_federation_retries_total",
        "Rounds over a twin's relays that all failed and were scheduled again",
        lambda: [((), stats.retries)],
    )
    registry.counter_of(
        "rmb_relay_federation_claimed_total",
        "Queued envelopes this instance took over from a stalled or dead one (with --redis)",
        lambda: [((), outbound.queue.claimed)],
    )
    registry.gauge(
        "rmb_relay_federation_queue_depth",
        "Envelopes this process holds for other relays (queued, in flight, waiting to retry)",
        read=lambda: [((), outbound.queue.depth())],
    )
    registry.gauge(
        "rmb_relay_federation_ranker_failures",
        "Failures of a relay domain within the ranker's window (--ranker-period)",
        ("domain",),
        read=lambda: [((d,), n) for d, (n, _) in ranker.snapshot().items()],
    )
    registry.gauge(
        "rmb_relay_federation_ranker_rate",
        "Failure rate of a relay domain in the ranker's window, per hour (lower is tried first)",
        ("domain",),
        read=lambda: [((d,), rate) for d, (_, rate) in ranker.snapshot().items()],
    )
    registry.gauge(
        "rmb_relay_federation_ranker_prior",
        "Prior failure rate of a relay domain from --ranker-priors (breaks ties)",
        ("domain",),
        read=lambda: [((d,), p) for d, p in sorted(ranker.priors.items())],
    )
    if inbound is not None:
        by_status = inbound.stats.by_status
        registry.counter_of(
            "rmb_relay_federation_in_total",
            "POST / requests from other relays, by answer (accepted, or the refusal's status)",
            lambda: [((label,), n) for label, n in sorted(by_status.items())],
            ("status",),
        )
