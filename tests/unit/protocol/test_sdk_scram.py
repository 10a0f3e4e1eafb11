"""SCRAM as the Couchbase SDKs speak it: their nonce (hex bytes separated by spaces) is
accepted, every other RFC 5802 rule still holds. The client side here is RFC 5802 §3 written
out with hashlib, as the SDK's C++ core computes it."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import random

import pytest
from scramp import ScramClient

from changefeed.protocol import scram
from changefeed.protocol.status import Status
from changefeed.server.authenticator import SaslAuthenticator
from changefeed.server.users import Users

HOST = "127.0.0.1"
HASH_NAMES = {"SCRAM-SHA512": "sha512", "SCRAM-SHA256": "sha256"}


@pytest.fixture(scope="module")
def users() -> Users:
    users = Users()
    users.add("alice", "secret")
    return users


def sdk_nonce(rng: random.Random) -> str:
    """What the C++ core sends: each of 8 random chars as ``0x%02x`` of its (sign-extended)
    value, separated by spaces (core/platform/string_hex.cc)."""
    chars = [rng.randrange(256) for _ in range(8)]
    return " ".join(f"0x{(c if c < 128 else c | 0xFFFFFF00):02x}" for c in chars)


class SdkClient:
    """RFC 5802 §3 over hashlib/hmac: what a client computes, with any nonce."""

    def __init__(self, mechanism: str, user: str, password: str, nonce: str) -> None:
        self.hash = HASH_NAMES[mechanism]
        self.password = password
        self.bare = f"n={user},r={nonce}"
        self.first = f"n,,{self.bare}"
        self.nonce = nonce

    def final(self, server_first: str, *, proof_fix: int = 0, binding: str = "biws") -> str:
        fields = dict(part.split("=", 1) for part in server_first.split(","))
        salt, iterations = base64.b64decode(fields["s"]), int(fields["i"])
        salted = hashlib.pbkdf2_hmac(self.hash, self.password.encode(), salt, iterations)
        client_key = hmac.digest(salted, b"Client Key", self.hash)
        stored_key = hashlib.new(self.hash, client_key).digest()
        without_proof = f"c={binding},r={fields['r']}"
        self.auth_message = f"{self.bare},{server_first},{without_proof}".encode()
        signature = hmac.digest(stored_key, self.auth_message, self.hash)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        proof = bytes([proof[0] ^ proof_fix]) + proof[1:]
        server_key = hmac.digest(salted, b"Server Key", self.hash)
        self.server_signature = hmac.digest(server_key, self.auth_message, self.hash)
        return f"{without_proof},p={base64.b64encode(proof).decode()}"


def exchange(
    users: Users, mechanism: str, first: str, final_of: object
) -> tuple[tuple[Status, bytes], tuple[Status, bytes] | None]:
    authenticator = SaslAuthenticator(users)

    async def run() -> tuple[tuple[Status, bytes], tuple[Status, bytes] | None]:
        started = await authenticator.sasl_auth(mechanism, first.encode(), HOST)
        if started[0] != Status.AUTH_CONTINUE:
            return started, None
        final = final_of(started[1].decode())  # type: ignore[operator]
        return started, await authenticator.sasl_step(mechanism, final.encode(), HOST)

    return asyncio.run(run())


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA512", "SCRAM-SHA256"])
def test_the_sdks_nonce_with_spaces_logs_in(
    users: Users, mechanism: str, rng: random.Random
) -> None:
    nonce = sdk_nonce(rng)
    assert " " in nonce and not scram.is_nonce(nonce, allow_spaces=False)
    client = SdkClient(mechanism, "alice", "secret", nonce)
    started, finished = exchange(users, mechanism, client.first, client.final)
    assert started[0] == Status.AUTH_CONTINUE
    assert started[1].decode().startswith(f"r={nonce}")  # the combined nonce keeps it as sent
    assert finished is not None and finished[0] == Status.SUCCESS
    assert finished[1] == b"v=" + base64.b64encode(client.server_signature)


def test_a_wrong_password_with_the_sdks_nonce_fails(users: Users, rng: random.Random) -> None:
    client = SdkClient("SCRAM-SHA512", "alice", "wrong", sdk_nonce(rng))
    _, finished = exchange(users, "SCRAM-SHA512", client.first, client.final)
    assert finished is not None and finished[0] == Status.AUTH_ERROR


def test_an_rfc_client_still_logs_in(users: Users) -> None:
    client = ScramClient(["SCRAM-SHA-256"], "alice", "secret")

    def final(server_first: str) -> str:
        client.set_server_first(server_first)
        return str(client.get_client_final())

    _, finished = exchange(users, "SCRAM-SHA256", client.get_client_first(), final)
    assert finished is not None and finished[0] == Status.SUCCESS
    client.set_server_final(finished[1].decode())  # scramp checks the server's signature


@pytest.mark.parametrize(
    ("first", "why"),
    [
        ("n,,n=alice,r= leading-space", "a nonce may not start with a space"),
        ("n,,n=alice,r=trailing-space ", "nor end with one"),
        ("n,,n=alice,r=tab\there", "other control characters stay out"),
        ("n,,n=alice,r=caf\u00e9", "so do non-ASCII characters"),
        ("n,,n=alice,r=", "an empty nonce"),
        ("n,,n=alice", "no nonce"),
        ("p=tls-unique,,n=alice,r=abc", "channel binding is not offered"),
        ("x,,n=alice,r=abc", "an unknown GS2 flag"),
        ("n,a=bob,n=alice,r=abc", "an authorization identity of someone else"),
        ("n,,m=ext,n=alice,r=abc", "the reserved m= extension"),
        ("n,,r=abc,n=alice", "attributes out of order"),
        ("n,,n=al=41ce,r=abc", "a name escape other than =2C and =3D"),
        ("n,,n=,r=abc", "an empty name"),
        ("n,,n=alice,r=abc,1=x", "an extension that does not start with a letter"),
        ("n,,n=alice,r=" + "a" * (scram.NONCE_SIZE_MAX + 1), "a nonce over the bound"),
    ],
)
def test_every_other_rfc_rule_still_holds_for_the_first_message(
    users: Users, first: str, why: str
) -> None:
    started, _ = exchange(users, "SCRAM-SHA512", first, lambda _: "")
    assert started[0] == Status.AUTH_ERROR, why


def test_escaped_names_and_the_users_own_authzid_are_accepted() -> None:
    parsed = scram.parse_client_first(b"y,a=a=2Cb,n=a=2Cb,r=0x01 0x02,x=1")
    assert parsed.user == "a,b" and parsed.nonce == "0x01 0x02"
    assert parsed.gs2_header == "y,a=a=2Cb," and parsed.bare == "n=a=2Cb,r=0x01 0x02,x=1"


@pytest.mark.parametrize(
    ("tamper", "why"),
    [
        (lambda f: f.replace("c=biws", "c=eSws"), "a binding that is not the GS2 header"),
        (lambda f: f.replace(",r=", ",r=x"), "another nonce"),
        (lambda f: f.replace(",p=", ",p=!"), "a proof that is not base64"),
        (lambda f: f[: f.index(",p=")] + ",p=AAAA", "a proof of the wrong length"),
        (lambda f: f.replace("c=biws,", ""), "no binding"),
        (lambda f: f.replace(",p=", ",e=x,p="), "an extension the proof does not cover"),
    ],
)
def test_the_final_message_is_checked(users: Users, rng: random.Random, tamper, why) -> None:  # type: ignore[no-untyped-def]
    client = SdkClient("SCRAM-SHA512", "alice", "secret", sdk_nonce(rng))
    _, finished = exchange(users, "SCRAM-SHA512", client.first, lambda s: tamper(client.final(s)))
    assert finished is not None and finished[0] == Status.AUTH_ERROR, why


def test_a_flipped_proof_bit_fails(users: Users, rng: random.Random) -> None:
    client = SdkClient("SCRAM-SHA256", "alice", "secret", sdk_nonce(rng))
    final = lambda s: client.final(s, proof_fix=1)  # noqa: E731
    _, finished = exchange(users, "SCRAM-SHA256", client.first, final)
    assert finished is not None and finished[0] == Status.AUTH_ERROR
