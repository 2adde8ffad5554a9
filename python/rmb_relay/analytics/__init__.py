"""The analytics plane: PySpark jobs over route records and rmb-load samples, and the report
(`rmb-analytics`, docs/analytics.md). Importing this package does not import Spark."""
