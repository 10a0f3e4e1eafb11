"""What ``changefeed mirror`` prints of a Spark error: the line that says what failed."""

from __future__ import annotations

from changefeed.cli.mirror import error_line


def test_a_py4j_error_shows_the_java_exception() -> None:
    text = (
        "An error occurred while calling o84.load.\n"
        ': java.io.IOException: Cannot run program "./env/bin/python": error=2\n'
        "\tat java.lang.ProcessBuilder.start(ProcessBuilder.java:1143)\n"
    )
    assert error_line(text) == 'java.io.IOException: Cannot run program "./env/bin/python": error=2'


def test_a_python_worker_traceback_shows_its_exception_line() -> None:
    text = (
        "[PYTHON_DATA_SOURCE_ERROR] Failed to create Python data source instance: Traceback "
        "(most recent call last):\n"
        '  File "/x/pyspark/sql/worker/create_data_source.py", line 142, in main\n'
        "    schema = data_source.schema()\n"
        "             ^^^^^^^^^^^^^^^^^^^^\n"
        "changefeed.spark.options.OptionError: format json needs option schema\n"
        " SQLSTATE: 38000\n"
        "\tat org.apache.spark.sql.errors.QueryCompilationErrors...\n"
    )
    assert error_line(text) == (
        "[PYTHON_DATA_SOURCE_ERROR] Failed to create Python data source instance: "
        "changefeed.spark.options.OptionError: format json needs option schema"
    )


def test_a_plain_message_is_its_first_line() -> None:
    assert error_line("  [STREAM_FAILED] it broke\nmore\n") == "[STREAM_FAILED] it broke"
    assert error_line("") == ""
