"""Operational telemetry: Prometheus metrics (and, later, route records for analytics)."""
