"""The --api-keys file: its format, the errors naming a line (never a key), finding the key in a
request, and the tenant-derived cache_salt."""

from __future__ import annotations

import pytest

from router.access import (
    MISSING_KEY,
    NOT_BEARER,
    WRONG_KEY,
    ApiKeys,
    ApiKeysFileError,
    presented_key,
    tenant_cache_salt,
)
from router.errors import Unauthenticated
from router.traffic_class import KeyClass, TrafficClass

KEY_A = "sk-a-0123456789abcdef"
KEY_A2 = "sk-a-fedcba9876543210"
KEY_B = "sk-b-0123456789abcdef"
GOOD = f"""# comment
{KEY_A} team-a

   {KEY_A2}\tteam-a   # rotated in on Monday
{KEY_B}    team-b
"""


def test_a_good_file_maps_each_key_to_its_tenant() -> None:
    keys = ApiKeys.parse(GOOD)
    assert keys.tenant(KEY_A) == keys.tenant(KEY_A2) == "team-a"
    assert keys.tenant(KEY_B) == "team-b"
    assert keys.tenant("sk-nobody-0123456789") is None
    assert keys.num_keys == 3 and keys.tenants == {"team-a", "team-b"}
    assert KEY_A not in repr(keys) and KEY_A not in str(dict(keys.tenant_by_digest))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            GOOD + f"{KEY_A}x team-c extra\n",
            "<api keys>:6: 'extra' is not NAME=VALUE",
        ),
        (f"{KEY_A}\n", ":1: expected `KEY TENANT [NAME=VALUE ...]`"),
        (f"{KEY_A} a\nshort-key a\n", ":2: the key is 9 characters; use at least 16"),
        (f"{KEY_A} a\n{KEY_B} b\n{KEY_A} c\n", ":3: this key was already given on line 1"),
        (f"{KEY_A} team,a\n", ":1: tenant 'team,a' may hold only"),
        ("sk-ünïcode-0123456789 a\n", ":1: the key holds characters other than visible ASCII"),
        ("# only comments\n\n", "no `KEY TENANT` line"),
    ],
)
def test_a_malformed_file_is_refused_naming_the_line_not_the_key(text: str, message: str) -> None:
    with pytest.raises(ApiKeysFileError) as info:
        ApiKeys.parse(text)
    assert message in str(info.value)
    for key in (KEY_A, KEY_B, "short-key"):
        assert key not in str(info.value)


def test_load_names_the_file(tmp_path) -> None:
    with pytest.raises(ApiKeysFileError, match=r"--api-keys .*missing: cannot read it"):
        ApiKeys.load(tmp_path / "missing")
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A} team-a\nbad\n")
    with pytest.raises(ApiKeysFileError, match=f"{path}:2: expected"):
        ApiKeys.load(path)
    bom = tmp_path / "keys-bom"  # saved by a Windows editor: its BOM is no part of the key
    bom.write_bytes(f"\ufeff{KEY_A} team-a\n".encode())
    bom.chmod(0o600)
    assert ApiKeys.load(bom).authenticate(f"Bearer {KEY_A}", None) == "team-a"


def test_the_key_is_found_in_bearer_or_x_api_key() -> None:
    assert presented_key(f"Bearer {KEY_A}", None) == KEY_A
    assert presented_key(f"bearer   {KEY_A} ", None) == KEY_A
    assert presented_key(None, f" {KEY_B}") == KEY_B
    assert presented_key(f"Basic {KEY_A}", KEY_B) == KEY_B  # Bearer only; else x-api-key
    assert presented_key("Bearer ", None) is None
    assert presented_key(None, None) is None and presented_key("", "") is None


def test_authenticate_names_what_is_wrong() -> None:
    keys = ApiKeys.parse(f"{KEY_A} team-a\n")
    assert keys.authenticate(f"Bearer {KEY_A}", None) == "team-a"
    with pytest.raises(Unauthenticated) as info:
        keys.authenticate(None, None)
    assert info.value.message == MISSING_KEY
    with pytest.raises(Unauthenticated) as info:
        keys.authenticate(f"Bearer {KEY_B}", None)
    assert info.value.message == WRONG_KEY and KEY_B not in str(info.value)
    with pytest.raises(Unauthenticated) as info:  # the key without its scheme: said so
        keys.authenticate(KEY_A, None)
    assert info.value.message == NOT_BEARER and KEY_A not in str(info.value)


def test_the_cache_salt_is_the_tenants_whatever_the_client_sends() -> None:
    a = tenant_cache_salt("team-a", None)
    assert a == tenant_cache_salt("team-a", None)  # stable: a tenant's requests share a cache
    assert len(a) == 64 and int(a, 16) >= 0
    # No salt team-b can send gives team-a's: not its name, not team-a's derived salt.
    for chosen in (None, "", "team-a", a, "team-a\x00", '["team-a", null]'):
        assert tenant_cache_salt("team-b", chosen) != a
    # A client's own salt still splits its tenant's cache; None and "" are different salts.
    assert tenant_cache_salt("team-a", "x") != a
    assert tenant_cache_salt("team-a", "") != a
    # Tenant and salt cannot be re-split ("ab" + "c" vs "a" + "bc").
    assert tenant_cache_salt("ab", "c") != tenant_cache_salt("a", "bc")


def test_class_and_weight_options_per_tenant_and_old_files_still_parse() -> None:
    text = f"{KEY_A} team-a class=batch weight=3\n{KEY_A2} team-a\n{KEY_B} team-b\n"
    keys = ApiKeys.parse(text)
    assert keys.key_class("team-a") == KeyClass(TrafficClass.BATCH, 3)
    assert keys.key_class("team-b") == keys.key_class(None) == KeyClass()
    assert ApiKeys.parse(GOOD).key_class("team-a") == KeyClass()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (f"{KEY_A} a class=bulk", ":1: class='bulk': the class is interactive or batch"),
        (f"{KEY_A} a weight=0", ":1: weight='0': the weight is an integer in [1, 1000]"),
        (f"{KEY_A} a weight=x", ":1: weight='x'"),
        (
            f"{KEY_A} a colour=red",
            ":1: unknown column 'colour' (known: rps, tpm, streams, class, weight)",
        ),
        (f"{KEY_A} a weight=2 weight=3", ":1: weight is given twice"),
        (
            f"{KEY_A} a class=batch\n{KEY_B} a class=interactive",
            ":2: tenant 'a' has class=interactive weight=1 here but class=batch weight=1 on line 1",
        ),
        (  # the weight differs, not the class: the message says both
            f"{KEY_A} a weight=2\n{KEY_B} a class=interactive",
            "class=interactive weight=1 here but class=interactive weight=2 on line 1",
        ),
    ],
)
def test_bad_class_options_are_refused_naming_the_line(line: str, message: str) -> None:
    with pytest.raises(ApiKeysFileError) as info:
        ApiKeys.parse(line + "\n")
    assert message in str(info.value) and KEY_A not in str(info.value)
