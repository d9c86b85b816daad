"""The status page talks to its own origin and to the shards its manager lists, nowhere
else: a link with `?shards=http://elsewhere` must not make it send the token the
operator types (issue: the page used to poll whatever `?shards=` said, with
`Authorization: Bearer <token>`). Run in a real chromium, with the page's own script."""

from __future__ import annotations

import urllib.request

from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.browser import browser as browser  # the fixture: a real chromium
from tests.conftest import Cluster, http, wait_for
from tests.security.recorder import recorder

TOKEN, ADMIN = "page-token", "page-admin-token"


def polls(driver: WebDriver) -> int:
    return int(driver.execute_script("return Number(document.body.dataset.polls || 0)"))


def test_a_foreign_shards_link_gets_no_request_and_no_token(
    cluster: Cluster, browser: WebDriver
) -> None:
    url = cluster.embedded(security__token=TOKEN, security__admin_token=ADMIN).manager_url
    with recorder() as (foreign, seen):
        browser.get(f"{url}/?interval=300&shards={foreign},{url}")
        wait_for(lambda: browser.find_element(By.ID, "login").is_displayed())
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#login button").click()
        # the page reads its own manager, and says which URL it would not follow
        wait_for(lambda: polls(browser) >= 3 or any(s.authorization for s in seen), timeout=15)
        assert not seen, f"the page contacted {foreign}: {seen}"
        assert browser.find_element(By.ID, "view").is_displayed()
        refused = browser.find_element(By.ID, "refused")
        assert refused.is_displayed() and foreign in refused.text and url not in refused.text

        # and even a script in the page could not: the CSP limits it to its own origin
        blocked = browser.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch(arguments[0] + '/v1/stats', {headers: {Authorization: 'Bearer ' + arguments[1]}})"
            ".then(() => done('sent'), err => done('blocked: ' + err));",
            foreign,
            TOKEN,
        )
        assert blocked.startswith("blocked"), blocked
        assert not seen, seen


def test_the_page_may_connect_to_its_origin_and_the_listed_shards_only(cluster: Cluster) -> None:
    listed = "http://127.0.0.1:1,http://localhost:2"  # two shards, as browsers reach them
    url = cluster.manager(
        manager__shard="1/2", manager__shard_urls=listed, security__grant_key="k" * 32
    ).manager_url
    status, health = http("GET", url + "/healthz")
    assert status == 200 and health["shard_urls"] == listed.split(",")
    policy = _csp(url)
    assert policy["connect-src"] == ["'self'", "http://127.0.0.1:1", "http://localhost:2"]
    assert policy["default-src"] == ["'none'"] and policy["frame-ancestors"] == ["'none'"]
    # unsharded and unconfigured: its own origin alone
    alone = cluster.manager().manager_url
    assert _csp(alone)["connect-src"] == ["'self'"]


def _csp(url: str) -> dict[str, list[str]]:
    with urllib.request.urlopen(url + "/", timeout=5) as resp:
        header = resp.headers["Content-Security-Policy"]
    return {
        name: values
        for name, *values in (part.split() for part in header.split(";") if part.strip())
    }
