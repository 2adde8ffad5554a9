"""Operational telemetry: Prometheus metrics and route records for the analytics plane.

| module | what |
|---|---|
| `metrics.py` | `Registry`: plain-number counters and gauges, exposed through prometheus_client |
| `records.py` | route records: the channels the hot path appends to, flushed in batches |
| `record_process.py` | the relay's side of the writer process: batches out, reports in |
| `record_writer.py` | the writer process itself: batches in, Parquet files out |
| `record_sample.py` | `--records-sample`: a Bernoulli sample of the hot path's rows |
| `record_schema.py` | the file format and its one pyarrow loader |
| `record_flags.py` | the `--records*` flags and the `rmb_relay_records_*` metrics |
"""
