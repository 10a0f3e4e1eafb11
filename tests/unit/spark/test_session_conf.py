"""The session's settings in layers: changefeed's defaults < the user's Spark configuration
(spark-defaults.conf, or spark-submit's) < the caller's ``--conf``; the master likewise, and
loopback only for a master on this host (issue 30 item 2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.spark.session import (
    CONF_DIR,
    DEFAULT_MASTER,
    DEFAULTS,
    LOOPBACK_DEFAULTS,
    SessionError,
    check_worker_python,
    parse_properties,
    session_conf,
)

keys = st.sampled_from([*DEFAULTS, *LOOPBACK_DEFAULTS, "spark.executor.memory", "spark.x"])
values = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=8)
layers = st.dictionaries(keys, values, max_size=6)
masters = st.sampled_from(["local[2]", "local", "spark://127.0.0.1:7077", "spark://10.0.0.5:7077",
                           "yarn", "k8s://https://api:6443"])  # fmt: skip


@given(layers, layers, st.none() | masters, st.none() | masters)
def test_later_layers_win(user: dict[str, str], given_conf: dict[str, str],
                          master: str | None, user_master: str | None) -> None:  # fmt: skip
    if user_master is not None:
        user = {**user, "spark.master": user_master}
    conf = session_conf(master, given_conf, user)
    want_master = master or user_master or DEFAULT_MASTER
    assert conf["spark.master"] == want_master
    loopback = want_master.startswith("local") or "127.0.0.1" in want_master
    for key in {*DEFAULTS, *LOOPBACK_DEFAULTS, *user, *given_conf} - {"spark.master"}:
        if key in given_conf:
            assert conf[key] == given_conf[key], key
        elif key in user:
            assert conf[key] == user[key], key
        elif key in DEFAULTS:
            assert conf[key] == DEFAULTS[key], key
        elif loopback:
            assert conf[key] == LOOPBACK_DEFAULTS[key], key
        else:  # a remote master: no loopback driver address, no setting the user did not make
            assert key not in conf, key


def test_a_remote_master_gets_no_loopback_driver() -> None:
    conf = session_conf("spark://10.0.0.5:7077", {}, {})
    assert "spark.driver.host" not in conf
    assert "spark.driver.bindAddress" not in conf
    assert session_conf(None, {}, {})["spark.driver.host"] == "127.0.0.1"  # local[2]


def test_parse_properties_reads_spark_defaults() -> None:
    text = (
        "# a comment\n! another\n\nspark.master   spark://h:7077\n"
        "spark.executor.memory=2g\nspark.ui.enabled: true\nspark.a.b\t x y \n"
    )
    assert parse_properties(text) == {
        "spark.master": "spark://h:7077",
        "spark.executor.memory": "2g",
        "spark.ui.enabled": "true",
        "spark.a.b": "x y",
    }


@given(st.dictionaries(st.from_regex(r"spark\.[a-z]{1,6}(\.[a-z]{1,6}){0,2}", fullmatch=True),
                       values, max_size=8),
       st.sampled_from([" ", "=", ": ", "\t"]))  # fmt: skip
def test_parse_properties_round_trip(conf: dict[str, str], sep: str) -> None:
    # As Java's Properties: one "=" or ":" after the key is the separator, not the value.
    conf = {k: v for k, v in conf.items() if v[0] not in "=:"}
    assert parse_properties("".join(f"{k}{sep}{v}\n" for k, v in conf.items())) == conf


def test_a_relative_worker_python_must_exist_for_the_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SessionError, match=r"\./env/bin/python.*tar -xf"):
        check_worker_python({"spark.pyspark.python": "./env/bin/python"})
    (tmp_path / "env" / "bin").mkdir(parents=True)
    (tmp_path / "env" / "bin" / "python").touch()
    check_worker_python({"spark.pyspark.python": "./env/bin/python"})
    check_worker_python({"spark.pyspark.python": "python3"})  # looked up on PATH: not ours


def test_spark_defaults_come_from_the_users_conf_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from changefeed.spark.session import prepare_environment, spark_defaults

    (tmp_path / "spark-defaults.conf").write_text("spark.master spark://h:7077\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    assert spark_defaults() == {"spark.master": "spark://h:7077"}
    prepare_environment()
    assert os.environ["SPARK_CONF_DIR"] == str(tmp_path)  # the user's, kept
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path / "missing"))
    assert spark_defaults() == {}
    prepare_environment()
    assert os.environ["SPARK_CONF_DIR"] == str(CONF_DIR)  # none there: the quiet logging
