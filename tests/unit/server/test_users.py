"""The users file: what it refuses at load and at ``add``, and PLAIN checks that never raise."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from changefeed.server.privileges import Privilege
from changefeed.server.users import (
    ITERATIONS,
    KEY_SIZES,
    NODE_SECRET_FILE,
    NODE_SECRET_SIZE,
    SALT_SIZE,
    Users,
    UsersError,
    decoy_keys,
    load_or_create_node_secret,
    password_matches,
)

# Passwords SASLprep (RFC 4013) prohibits: ASCII and non-ASCII control characters, a private-use
# code point, and a right-to-left string that ends left-to-right (RFC 3454 §6).
PROHIBITED_PASSWORDS = ["pass\x07word", "abc\x7f", "\x1b[2J", "\ue000", "\u06271"]


def test_an_empty_password_is_refused() -> None:
    with pytest.raises(UsersError, match="empty password"):
        Users().add("alice", "")


@pytest.mark.parametrize("password", PROHIBITED_PASSWORDS)
def test_a_password_with_control_characters_fails_the_check_cleanly(password: str) -> None:
    users = Users()
    users.add("alice", "secret")
    assert users.check_password("alice", password) is False
    assert users.check_password("alice", "secret") is True


def write_users_file(tmp_path: Path, **changes: object) -> Path:
    """A users file with one user 'alice' whose SCRAM-SHA512 entry gets ``changes``."""
    users = Users()
    users.add("alice", "secret")
    path = tmp_path / "users.json"
    users.save(path)
    raw = json.loads(path.read_text())
    raw["alice"]["SCRAM-SHA512"].update(changes)
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"salt": ""}, "salt"),
        ({"salt": "abcd"}, "salt"),
        ({"salt": "00" * 11}, "salt"),
        ({"iterations": 1000}, "iterations"),
        ({"iterations": 0}, "iterations"),
        ({"stored_key": "00" * 16}, "stored_key"),
        ({"server_key": ""}, "server_key"),
    ],
)
def test_a_malformed_entry_is_refused_at_load_not_at_login(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    path = write_users_file(tmp_path, **changes)
    with pytest.raises(UsersError, match=rf"{path}.*'alice'.*{message}"):
        Users.load(path)


def test_a_password_saslprep_refuses_is_refused_by_add() -> None:
    with pytest.raises(UsersError, match="password for user 'alice' is refused"):
        Users().add("alice", "pass\x07word")


def test_a_users_file_written_before_roles_loads_with_admin(tmp_path: Path) -> None:
    path = write_users_file(tmp_path)
    raw = json.loads(path.read_text())
    assert raw["alice"].pop("roles") == ["admin"]
    path.write_text(json.dumps(raw))
    users = Users.load(path)
    assert users.roles("alice") == ("admin",)
    assert users.privileges("alice") == frozenset(Privilege)
    assert users.check_password("alice", "secret")


def test_roles_round_trip_and_grant_privileges(tmp_path: Path) -> None:
    users = Users()
    users.add("reader", "pw", roles=["data_reader", "data_dcp_reader"])
    users.add("writer", "pw", roles="data_writer")  # one name, not its letters
    users.add("root", "pw")
    users.save(tmp_path / "users.json")
    loaded = Users.load(tmp_path / "users.json")
    assert loaded.roles("reader") == ("data_reader", "data_dcp_reader")
    assert loaded.privileges("reader") == {Privilege.READ, Privilege.DCP_STREAM}
    assert loaded.roles("writer") == ("data_writer",)
    assert loaded.privileges("writer") == {Privilege.WRITE}
    assert loaded.roles("root") == ("admin",)
    assert loaded.roles("nobody") == ()
    assert loaded.privileges("nobody") == frozenset()


def test_a_new_password_keeps_the_roles_unless_given() -> None:
    users = Users()
    users.add("alice", "one", roles=["data_reader"])
    users.add("alice", "two")
    assert users.roles("alice") == ("data_reader",)
    assert users.check_password("alice", "two")
    users.add("alice", "three", roles=["data_writer"])
    assert users.roles("alice") == ("data_writer",)


@pytest.mark.parametrize(
    ("roles", "message"),
    [(["superuser"], "unknown role 'superuser'"), ([], "needs at least one role")],
)
def test_add_refuses_bad_roles(roles: list[str], message: str) -> None:
    users = Users()
    with pytest.raises(UsersError, match=message):
        users.add("alice", "pw", roles=roles)
    assert "alice" not in users


def test_salts_are_the_length_decoys_have() -> None:
    users = Users()
    users.add("alice", "pw")
    for mechanism, size in KEY_SIZES.items():
        keys = users.scram_keys("alice", mechanism)
        assert keys is not None
        assert len(keys.salt) == SALT_SIZE
        decoy = decoy_keys(b"s" * NODE_SECRET_SIZE, "bob", mechanism)
        assert len(decoy.salt) == SALT_SIZE
        assert len(decoy.stored_key) == len(keys.stored_key) == size
        assert len(decoy.server_key) == len(keys.server_key) == size
        assert decoy.iterations == keys.iterations == ITERATIONS


def test_decoys_depend_on_the_secret_the_name_and_the_mechanism_only() -> None:
    secret = b"s" * NODE_SECRET_SIZE
    decoy = decoy_keys(secret, "bob", "SCRAM-SHA512")
    assert decoy_keys(secret, "bob", "SCRAM-SHA512") == decoy
    assert decoy_keys(secret, "bob", "SCRAM-SHA256").salt != decoy.salt
    assert decoy_keys(secret, "bobby", "SCRAM-SHA512").salt != decoy.salt
    assert decoy_keys(b"t" * NODE_SECRET_SIZE, "bob", "SCRAM-SHA512").salt != decoy.salt
    assert not password_matches(decoy, "")
    assert not password_matches(decoy, "password")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"roles": ["superuser"]}, "unknown role 'superuser'"),
        ({"roles": "admin"}, "roles is str, not a list"),
        ({"roles": []}, "needs at least one role"),
        ({"password": "x"}, r"unknown fields \['password'\]"),
    ],
)
def test_a_malformed_user_entry_is_refused_at_load(
    tmp_path: Path, entry: dict[str, object], message: str
) -> None:
    path = write_users_file(tmp_path)
    raw = json.loads(path.read_text())
    raw["alice"].update(entry)
    path.write_text(json.dumps(raw))
    with pytest.raises(UsersError, match=rf"'alice'.*{message}"):
        Users.load(path)


def test_a_user_without_a_mechanism_is_refused_at_load(tmp_path: Path) -> None:
    path = write_users_file(tmp_path)
    raw = json.loads(path.read_text())
    del raw["alice"]["SCRAM-SHA256"]
    path.write_text(json.dumps(raw))
    with pytest.raises(UsersError, match="'alice': no SCRAM-SHA256 keys"):
        Users.load(path)


def test_the_users_file_is_private(tmp_path: Path) -> None:
    path = write_users_file(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_node_secret_is_made_once_private_and_kept(tmp_path: Path) -> None:
    secret = load_or_create_node_secret(tmp_path)
    path = tmp_path / NODE_SECRET_FILE
    assert len(secret) == NODE_SECRET_SIZE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_node_secret(tmp_path) == secret
    assert load_or_create_node_secret(tmp_path / "other") != secret


def test_a_truncated_node_secret_is_refused(tmp_path: Path) -> None:
    (tmp_path / NODE_SECRET_FILE).write_bytes(b"short")
    with pytest.raises(UsersError, match=r"node secret .* is 5 bytes, not 32; delete it"):
        load_or_create_node_secret(tmp_path)
