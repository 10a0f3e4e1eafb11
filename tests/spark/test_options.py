"""``SourceOptions.parse``: defaults, Kafka-style names (case-insensitive, as Spark passes
them), and an ``OptionError`` naming the option for every bad value."""

from __future__ import annotations

import pytest

from changefeed.spark.options import OptionError, SourceOptions


def test_defaults() -> None:
    options = SourceOptions.parse({})
    assert (options.host, options.port, options.bucket) == ("127.0.0.1", 11210, "default")
    assert options.starting_offsets == "earliest"
    assert options.max_offsets_per_trigger == 0
    assert options.fail_on_data_loss is True
    assert options.partitions == 2
    assert options.vbucket_ids(4) == [0, 1, 2, 3]
    assert options.starting_json() is None


def test_names_are_case_insensitive_and_prefixes_allowed() -> None:
    options = SourceOptions.parse(
        {
            "Cluster": "couchbase://db.example:12000",
            "MAXOFFSETSPERTRIGGER": "500",
            "failondataloss": "FALSE",
            "startingOffsets": "latest",
            "partitions": "0",
        }
    )
    assert (options.host, options.port) == ("db.example", 12000)
    assert options.max_offsets_per_trigger == 500
    assert options.fail_on_data_loss is False
    assert options.starting_offsets == "latest"
    assert options.partitions == 1, "at least one Spark partition"
    assert SourceOptions.parse({"cluster": "changefeed://[::1]:7"}).host == "[::1]"


def test_credentials_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHANGEFEED_USER", "reader")
    monkeypatch.setenv("CHANGEFEED_PASSWORD", "s3cret")
    options = SourceOptions.parse({})
    assert (options.user, options.password) == ("reader", "s3cret")
    assert SourceOptions.parse({"user": "u", "password": "p"}).user == "u"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"cluster": "localhost"}, "cluster"),
        ({"cluster": "localhost:port"}, "cluster"),
        ({"cluster": ":11210"}, "cluster"),
        ({"maxOffsetsPerTrigger": "lots"}, "maxoffsetspertrigger"),
        ({"maxOffsetsPerTrigger": "-1"}, "maxoffsetspertrigger"),
        ({"maxOffsetsPerTrigger": "1.5"}, "maxoffsetspertrigger"),
        ({"partitions": "two"}, "partitions"),
        ({"failOnDataLoss": "yes"}, "failondataloss"),
        ({"failOnDataLoss": ""}, "failondataloss"),
    ],
)
def test_parse_errors_name_the_option(options: dict[str, str], named: str) -> None:
    with pytest.raises(OptionError, match=f"option {named}"):
        SourceOptions.parse(options)


def test_vbucket_lists() -> None:
    assert SourceOptions.parse({"vbuckets": "0-3,8, 2"}).vbucket_ids(16) == [0, 1, 2, 3, 8]
    assert SourceOptions.parse({"vbuckets": "15"}).vbucket_ids(16) == [15]


@pytest.mark.parametrize("vbuckets", ["a-b", "1-", "3-1", "0-16", "16", "-1", "", "1,,2"])
def test_vbucket_list_errors_name_the_option(vbuckets: str) -> None:
    options = SourceOptions.parse({"vbuckets": vbuckets})  # checked once the count is known
    with pytest.raises(OptionError, match="option vbuckets"):
        options.vbucket_ids(16)


def test_starting_offsets_json() -> None:
    raw = '{"3": {"vb_uuid": 7, "seqno": 10}}'
    assert SourceOptions.parse({"startingOffsets": raw}).starting_json() == {
        "3": {"vb_uuid": 7, "seqno": 10}
    }


@pytest.mark.parametrize("raw", ["earliest-ish", "[1, 2]", "{", '"latest"'])
def test_starting_offsets_errors_name_the_option(raw: str) -> None:
    options = SourceOptions.parse({"startingOffsets": raw})
    with pytest.raises(OptionError, match="option startingOffsets"):
        options.starting_json()


def test_option_error_is_a_value_error() -> None:
    assert issubclass(OptionError, ValueError)


def test_document_options() -> None:
    default = SourceOptions.parse({})
    assert (default.format, default.mode, default.infer_schema) == ("json", "PERMISSIVE", True)
    given = SourceOptions.parse({"schema": "a int", "MODE": "failfast", "format": "JSON"})
    assert (given.format, given.mode, given.infer_schema) == ("json", "FAILFAST", False)
    assert given.schema == "a int" and given.documents_as_json
    assert not SourceOptions.parse({"format": "binary"}).documents_as_json


@pytest.mark.parametrize(
    ("name", "raw"), [("format", "xml"), ("mode", "lenient"), ("inferSchema", "maybe")]
)
def test_document_option_errors_name_the_option(name: str, raw: str) -> None:
    with pytest.raises(OptionError, match=f"option {name.lower()}"):
        SourceOptions.parse({name: raw})
