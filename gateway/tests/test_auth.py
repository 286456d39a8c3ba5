"""Browser authentication: bearer tokens of configured users, 401 (AIP-193) for anything else."""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

import httpx
import pytest
from gateway_testing import ALICE_TOKEN, BOB_TOKEN, assert_error, bearer, gateway_settings, serving, unused_address
from pydantic import SecretStr, ValidationError

from continuum_gateway.app import create_app
from continuum_gateway.auth import Authenticator, bearer_subprotocol
from continuum_gateway.settings import GatewaySettings


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer not-a-known-token"},
        {"Authorization": f"Basic {ALICE_TOKEN}"},
        {"Authorization": "Bearer "},
        {"Authorization": ALICE_TOKEN},
        {"Authorization": f"Bearer {ALICE_TOKEN}x"},
    ],
    ids=["missing", "unknown", "wrong-scheme", "empty", "no-scheme", "prefix-of-a-token"],
)
async def test_requests_without_a_known_token_are_401(
    offline_gateway: httpx.AsyncClient, headers: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        response = await offline_gateway.get("/v1/sessions", headers=headers)
    error = assert_error(response, 401, "UNAUTHENTICATED", "UNAUTHENTICATED")
    assert error["details"][0]["domain"] == "gateway.continuum"
    assert response.headers["www-authenticate"] == "Bearer"
    assert ALICE_TOKEN not in caplog.text


async def test_unknown_paths_do_not_reveal_themselves_to_strangers(offline_gateway: httpx.AsyncClient) -> None:
    assert_error(await offline_gateway.get("/v1/no-such-thing"), 401, "UNAUTHENTICATED")


async def test_probes_need_no_token(offline_gateway: httpx.AsyncClient) -> None:
    assert (await offline_gateway.get("/healthz")).status_code == 200
    assert (await offline_gateway.get("/readyz")).status_code == 503


async def test_a_known_token_passes_authentication(offline_gateway: httpx.AsyncClient) -> None:
    # Past authentication the request reaches the (absent) upstream: 503, not 401.
    response = await offline_gateway.get("/v1/sessions", headers=bearer(ALICE_TOKEN))
    assert_error(response, 503, "UNAVAILABLE")


# The gateway derives the acting user from the bearer token alone: the header the services read it
# from is the gateway's to set, never the browser's.
ACTING_USER_HEADERS = [{"x-continuum-user": "alice"}, {"X-Continuum-User": "alice"}]


@pytest.mark.parametrize("claimed", ACTING_USER_HEADERS, ids=["lower-case", "mixed-case"])
async def test_a_client_sent_acting_user_header_is_ignored(gateway: httpx.AsyncClient, claimed: dict[str, str]) -> None:
    alice_session = f"s-{uuid.uuid4().hex[:12]}"
    created = await gateway.post("/v1/sessions", headers=bearer(ALICE_TOKEN), json={"sessionId": alice_session})
    assert created.status_code == 201, created.text
    bob = {**bearer(BOB_TOKEN), **claimed}
    injected = {"role": "MESSAGE_ROLE_USER", "content": [{"text": "written as alice"}]}

    for response in (
        await gateway.get(f"/v1/sessions/{alice_session}", headers=bob),
        await gateway.get(f"/v1/sessions/{alice_session}/messages", headers=bob),
        await gateway.post(f"/v1/sessions/{alice_session}/messages", headers=bob, json={"messages": [injected]}),
        await gateway.get(f"/v1/sessions/{alice_session}/compaction", headers=bob),
    ):
        assert_error(response, 403, "PERMISSION_DENIED", "SESSION_PERMISSION_DENIED")
    unchanged = await gateway.get(f"/v1/sessions/{alice_session}/messages", headers=bearer(ALICE_TOKEN))
    assert unchanged.status_code == 200, unchanged.text
    assert unchanged.json().get("messages", []) == []
    listed = await gateway.get("/v1/sessions", headers=bob, params={"pageSize": 1000})
    assert listed.status_code == 200, listed.text
    assert alice_session not in [s["sessionId"] for s in listed.json().get("sessions", [])]
    # What Bob creates is Bob's, whoever the header names.
    bob_session = f"s-{uuid.uuid4().hex[:12]}"
    made = await gateway.post("/v1/sessions", headers=bob, json={"sessionId": bob_session})
    assert made.status_code == 201, made.text
    assert made.json()["session"]["owner"] == "bob"
    assert (await gateway.get(f"/v1/sessions/{bob_session}", headers=bearer(BOB_TOKEN))).status_code == 200
    assert_error(
        await gateway.get(f"/v1/sessions/{bob_session}", headers=bearer(ALICE_TOKEN)),
        403,
        "PERMISSION_DENIED",
        "SESSION_PERMISSION_DENIED",
    )


@pytest.mark.parametrize("claimed", ACTING_USER_HEADERS, ids=["lower-case", "mixed-case"])
async def test_an_acting_user_header_is_no_credential(gateway: httpx.AsyncClient, claimed: dict[str, str]) -> None:
    for headers in (claimed, {**claimed, "Authorization": "Bearer not-a-known-token"}):
        assert_error(await gateway.get("/v1/sessions", headers=headers), 401, "UNAUTHENTICATED", "UNAUTHENTICATED")


async def test_dev_token_acts_as_dev(tmp_path: Path) -> None:
    settings = gateway_settings(tmp_path, unused_address(), users={}, dev_token=SecretStr("let-me-in"))
    async with serving(create_app(settings)) as client:
        assert_error(await client.get("/v1/sessions", headers=bearer("let-me-in")), 503, "UNAVAILABLE")
        assert_error(await client.get("/v1/sessions", headers=bearer(ALICE_TOKEN)), 401, "UNAUTHENTICATED")


def test_authenticator_resolves_tokens_case_insensitive_scheme() -> None:
    authenticator = Authenticator({"t0k": "alice"})
    assert authenticator.user_for("Bearer t0k") == "alice"
    assert authenticator.user_for("bearer t0k") == "alice"
    assert authenticator.user_for("Bearer T0K") is None
    assert authenticator.user_for(None) is None


def test_bearer_subprotocols_carry_any_token_as_a_header_token() -> None:
    token = "t/0+k=n with spaces ü"
    authenticator = Authenticator({token: "alice", "bob-token": "bob"})
    subprotocol = bearer_subprotocol(token)
    # RFC 7230 token characters only, as browsers require of subprotocols.
    assert re.fullmatch(r"[A-Za-z0-9._-]+", subprotocol), subprotocol
    assert authenticator.user_for_subprotocols(["continuum.follow.v1", subprotocol]) == "alice"
    assert authenticator.user_for_subprotocols([subprotocol, bearer_subprotocol("bob-token")]) is None
    assert authenticator.user_for_subprotocols(["continuum.follow.v1"]) is None
    assert authenticator.user_for_subprotocols(["continuum.bearer."]) is None
    assert authenticator.user_for_subprotocols(["continuum.bearer.%%%"]) is None
    assert authenticator.user_for_subprotocols(["continuum.bearer." + "_w"]) is None  # not UTF-8
    # The raw token is not a credential: only its encoding is.
    assert authenticator.user_for_subprotocols(["continuum.bearer.bob-token"]) is None


def test_users_come_from_json_and_never_show_in_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_USERS", '{"secret-alice": "alice", "secret-bob": "bob"}')
    monkeypatch.setenv("GATEWAY_DEV_TOKEN", "secret-dev")
    monkeypatch.setenv("GATEWAY_SERVICE_TOKEN", "secret-service")
    monkeypatch.setenv("GATEWAY_PORT", "0")
    settings = GatewaySettings()
    assert settings.user_tokens() == {"secret-alice": "alice", "secret-bob": "bob", "secret-dev": "dev"}
    assert settings.port == 0
    assert "secret" not in repr(settings)
    assert "secret" not in str(settings.model_dump())


@pytest.mark.parametrize(
    "overrides",
    [
        {"users": {SecretStr("secret-t"): "not a valid user"}},
        {"users": {SecretStr(""): "alice"}},
        {"dev_token": SecretStr("")},
        {"users": {SecretStr("secret-t"): "alice"}, "dev_token": SecretStr("secret-t")},
    ],
    ids=["bad-user-id", "empty-token", "empty-dev-token", "dev-token-of-another-user"],
)
def test_misconfigured_users_fail_at_start_without_quoting_secrets(overrides: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as caught:
        GatewaySettings(service_token=SecretStr("secret-service"), **overrides)  # type: ignore[arg-type]
    assert "secret" not in str(caught.value)


def test_invalid_users_json_fails_without_quoting_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_USERS", '{"secret-token": "bob"')
    with pytest.raises(ValueError, match="users") as caught:
        GatewaySettings()
    assert "secret" not in str(caught.value)


def test_validation_errors_do_not_quote_environment_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_SERVICE_TOKEN", "secret-service")
    monkeypatch.setenv("GATEWAY_USERS", '{"secret-token": "not a valid user"}')
    with pytest.raises(ValidationError) as caught:
        GatewaySettings()
    assert "not a valid user" in str(caught.value)
    assert "secret" not in str(caught.value)
