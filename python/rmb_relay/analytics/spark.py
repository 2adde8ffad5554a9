"""The SparkSession rmb-analytics runs on: local mode by default, any master by flag.

Spark's JVM logs a lot at start (and a stack trace per failed task); the user of a command-line
tool wants its progress and one line per problem. The driver's log4j is therefore set to ERROR
for Spark's chatty packages (the root stays at WARN and `org.apache.spark` itself unset: in
shell mode Spark compares its REPL logger with the root and prints a notice when they differ;
OFF for the task-failure loggers, whose errors reach us as a Python exception
anyway), and Spark's own console progress bar stays on: it is what moves while a stage runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"

_LOG4J = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.executor.name = org.apache.spark.executor.Executor
logger.executor.level = off
logger.tasks.name = org.apache.spark.scheduler.TaskSetManager
logger.tasks.level = off
logger.hadoop.name = org.apache.hadoop
logger.hadoop.level = off
logger.sql.name = org.apache.spark.sql
logger.sql.level = error
logger.util.name = org.apache.spark.util
logger.util.level = error
logger.storage.name = org.apache.spark.storage
logger.storage.level = error
logger.scheduler.name = org.apache.spark.scheduler
logger.scheduler.level = error
logger.conf.name = org.apache.spark.SparkConf
logger.conf.level = error
logger.context.name = org.apache.spark.SparkContext
logger.context.level = error
logger.sparkproject.name = org.sparkproject
logger.sparkproject.level = error
"""


def _log4j_file() -> Path:
    path = Path(tempfile.gettempdir()) / f"rmb-analytics-log4j2-{os.getuid()}.properties"
    if not path.exists() or path.read_text() != _LOG4J:
        path.write_text(_LOG4J)
    return path


def session(
    master: str = DEFAULT_MASTER,
    *,
    progress: bool = True,
    shuffle_partitions: int | None = None,
    extra: dict[str, str] | None = None,
) -> SparkSession:
    """A SparkSession on `master` (reused if one is already running in this process).

    `shuffle_partitions` defaults to 2x the local cores in local mode (Spark's 200 is for
    clusters; on 2 cores it is 200 tiny tasks per shuffle) and to Spark's default elsewhere."""
    from pyspark.sql import SparkSession

    # the workers must run the same Python as the driver
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    log4j = f"-Dlog4j2.configurationFile=file:{_log4j_file()}"
    builder = (
        SparkSession.builder.master(master)
        .appName("rmb-analytics")
        .config("spark.driver.extraJavaOptions", log4j)
        .config("spark.executor.extraJavaOptions", log4j)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "true" if progress else "false")
        .config("spark.sql.adaptive.enabled", "true")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
    )
    if shuffle_partitions is None and master.startswith("local"):
        shuffle_partitions = 2 * (os.cpu_count() or 1)
    if shuffle_partitions is not None:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    for key, value in (extra or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def java_message(err: BaseException) -> str:
    """The first line of a Spark/Py4J error, without the JVM stack trace."""
    text = getattr(err, "desc", None) or str(err)
    java = getattr(err, "java_exception", None)
    if java is not None:
        with contextlib.suppress(Exception):  # the JVM may be gone
            text = str(java.getMessage()) or text
    for line in str(text).splitlines():
        line = line.strip()
        if line:
            return line[:300]
    return type(err).__name__
