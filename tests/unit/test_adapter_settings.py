"""Engine adapters' settings (polarkv_lib/integrations/common.py): what an engine's
extra config may say, and the token kept out of it (engines log their extra config)."""

from __future__ import annotations

import pytest

from polarkv_lib.integrations.common import TOKEN_ENV, settings_from_extra

URL = "http://127.0.0.1:8170"


def test_the_token_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-the-env-0001")
    assert settings_from_extra({"manager_url": URL}).token == "from-the-env-0001"
    # one written in the extra config wins: it names this engine's own tenant
    assert settings_from_extra({"manager_url": URL, "token": "t-extra-01"}).token == "t-extra-01"


def test_no_token_anywhere_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert settings_from_extra({"manager_url": URL}).token is None


@pytest.mark.parametrize(
    "extra,message",
    [
        ({}, "needs 'manager_url'"),
        ({"manager_url": URL, "chunk_tokens": 0}, "'chunk_tokens' must be a positive integer"),
        ({"manager_url": URL, "timeout": "soon"}, "'timeout' must be a positive number"),
    ],
)
def test_bad_settings_name_the_key(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings_from_extra(extra)
