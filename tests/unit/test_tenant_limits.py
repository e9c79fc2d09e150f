"""Per-key limits as configured: the API-key file's optional `rps= tpm= streams=` columns (old
files still parse; a bad column is an error naming the file's line, never the key), the
--rate-limit-* defaults they override, and the `kvrelay status --keys` table (no Redis)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.cli import build_parser, main
from deploy.ops_cli import format_key_usage, key_usage
from deploy.router_flags import RouterOptions, router_options
from router.access import ApiKeys, ApiKeysFileError
from router.rate_limit_schema import USAGE_FIELDS, TenantUsage
from router.tenant_limits import NO_LIMITS, TenantLimits

KEY_A = "sk-a-0123456789abcdef"
KEY_A2 = "sk-a-fedcba9876543210"
KEY_B = "sk-b-0123456789abcdef"
KEY_C = "sk-c-0123456789abcdef"


def test_limit_columns_give_each_tenant_its_limits_and_old_lines_none() -> None:
    keys = ApiKeys.parse(
        f"{KEY_A} team-a rps=2.5 tpm=20000  # interactive\n"
        f"{KEY_A2} team-a\n"  # a rotated key: the tenant's limits, given once
        f"{KEY_B} team-b streams=4 rps=1 tpm=600\n"
        f"{KEY_C} team-c\n"
    )
    assert keys.limits("team-a") == TenantLimits(rps=2.5, tpm=20000)
    assert keys.limits("team-b") == TenantLimits(rps=1, tpm=600, streams=4)
    assert keys.limits("team-c") == NO_LIMITS and not NO_LIMITS.any
    assert keys.tenant(KEY_A2) == "team-a" and keys.num_keys == 4
    assert isinstance(keys.limits("team-b").tpm, int)
    assert keys.limits("team-b").describe() == "rps=1 tpm=600 streams=4"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("rps=0", ":2: rps must be a positive number, got 0"),
        ("rps=-1", ":2: rps must be a positive number, got -1"),
        ("rps=nan", ":2: rps must be a positive number, got nan"),
        ("tpm=lots", ":2: tpm='lots' is not a number"),
        ("streams=1.5", ":2: streams must be a whole number, got 1.5"),
        ("burst=3", ":2: unknown column 'burst' (known: rps, tpm, streams, class, weight)"),
        ("rps=1 rps=2", ":2: rps is given twice"),
        ("rps=", ":2: 'rps=' is not NAME=VALUE"),
        ("rps", ":2: 'rps' is not NAME=VALUE"),
    ],
)
def test_a_bad_limit_column_is_refused_naming_the_line(line: str, message: str) -> None:
    with pytest.raises(ApiKeysFileError) as info:
        ApiKeys.parse(f"{KEY_A} team-a\n{KEY_B} team-b {line}\n", "keys.txt")
    assert f"keys.txt{message}" in str(info.value)
    assert KEY_B not in str(info.value)


def test_a_tenant_given_two_different_limits_is_refused() -> None:
    ApiKeys.parse(f"{KEY_A} team-a rps=2\n{KEY_A2} team-a rps=2\n")  # the same twice is fine
    with pytest.raises(ApiKeysFileError, match=r":2: tenant 'team-a' has other limits on line 1"):
        ApiKeys.parse(f"{KEY_A} team-a rps=2\n{KEY_A2} team-a rps=3\n")


def options(*argv: str) -> RouterOptions:
    return router_options(build_parser().parse_args(["router", *argv]))


def test_flags_give_the_default_limits_a_key_line_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} team-a tpm=500\n{KEY_B} team-b\n")
    got = options("--api-keys", str(keys), "--rate-limit-rps", "0.5", "--rate-limit-tpm", "900")
    assert got.default_limits == TenantLimits(rps=0.5, tpm=900)
    assert got.api_keys is not None
    assert got.api_keys.limits("team-a").over(got.default_limits) == TenantLimits(0.5, 500)
    assert got.api_keys.limits("team-b").over(got.default_limits) == TenantLimits(0.5, 900)
    assert any("per-key limits" in line for line in got.describe())
    assert options().default_limits == NO_LIMITS
    with pytest.raises(SystemExit):  # refused while parsing, one line naming the flag
        options("--api-keys", str(keys), "--rate-limit-streams", "0")
    assert "argument --rate-limit-streams: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--rate-limit-\* needs --api-keys"):
        options("--rate-limit-rps", "3")
    assert got.has_limits and not options().has_limits
    argv = ["serve", "--no-redis", "--api-keys", str(keys)]
    assert main(argv) == 2  # refused before anything starts
    assert "per-key limits (the key file's columns, --rate-limit-*) need Redis" in (
        capsys.readouterr().err
    )


def test_status_keys_table_has_a_row_a_tenant() -> None:
    counts = dict.fromkeys(USAGE_FIELDS, 0) | {"requests": 12, "refused_rps": 3}
    rows = [
        TenantUsage("team-a", "rps=3", 2, counts | {"prompt_tokens": 340}),
        TenantUsage("team-b", "", 0, dict.fromkeys(USAGE_FIELDS, 0)),
    ]
    lines = format_key_usage(rows).splitlines()
    assert lines[0] == "keys: 2 tenants"
    assert lines[1].split()[:2] == ["tenant", "requests"]
    assert lines[2].split() == ["team-a", "12", "340", "0", "2", "3/0/0", "rps=3"]
    assert lines[3].split() == ["team-b", "0", "0", "0", "0", "0/0/0", "none"]


def test_status_takes_keys_and_says_when_there_is_no_redis() -> None:
    assert build_parser().parse_args(["status", "--keys"]).keys
    assert key_usage("") == "keys: no Redis, so no per-key usage"
    assert key_usage("redis://127.0.0.1:1/0").startswith("keys: Redis did not answer")
