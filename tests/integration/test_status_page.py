"""The status page in a real browser (Debian's chromium, driven by selenium through
chromedriver) against a running PolarKV under a small load: it asks for the token once,
then shows the same numbers as /v1/stats and /v1/nodes, draws its charts and lists the
node events. A screenshot of it is saved (to docs/status-page.png with
POLARKV_UPDATE_SCREENSHOT=1, which README shows).

scripts/setup-browser installs chromium and chromedriver."""

from __future__ import annotations

import os
import shutil
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from polarkv_lib.client import PolarKVClient
from polarkv_lib.manager.openapi import openapi_spec
from polarkv_lib.wire import frames
from polarkv_lib.wire.grants import Op
from tests.browser import browser as browser  # the fixture: a real chromium
from tests.conftest import ROOT, Cluster, free_port, http, wait_for
from tests.integration.raw import key, only, post, raw, write

TOKEN, ADMIN = "page-token", "page-admin-token"
SCREENSHOT = ROOT / "docs" / "status-page.png"


class Load:
    """A small, bounded mixed load: stores and loads of 64 KiB values over a working set
    larger than memory, so offloads and reloads happen too."""

    def __init__(self, url: str, keys: int = 800, size: int = 64 * 1024) -> None:
        self.url, self.keys, self.size = url, keys, size
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="page-load", daemon=True)

    def _run(self) -> None:
        try:
            with PolarKVClient(self.url, token=TOKEN, timeout=5.0) as client:
                i = 0
                while not self.stop.is_set() and i < 20_000:
                    # writes walk the whole working set; half the reads stay on a hot
                    # set that memory keeps, the rest come back from disk
                    hot = i >= self.keys and i % 3 != 0 and i % 2 == 0
                    key = f"{(i * 7919) % (64 if hot else self.keys):032x}"
                    if i < self.keys or i % 3 == 0:
                        client.put(key, key.encode()[:16] * (self.size // 16))
                    else:
                        value = client.get(key)
                        assert value is None or value[:16] == key.encode()[:16]
                    i += 1
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


# The page re-renders its cards and rows on every poll, so an element found by one call
# may be gone by the next (StaleElementReferenceException). Every read of moving parts is
# one script run in the page: a consistent snapshot of one render.
def page_values(driver: WebDriver) -> dict[str, str]:
    values: dict[str, str] = driver.execute_script(
        "const o = {}; for (const e of document.querySelectorAll('[data-stat]'))"
        " o[e.getAttribute('data-stat') || ''] = e.getAttribute('data-value') || ''; return o;"
    )
    return values


def text_of(driver: WebDriver, selector: str) -> str:
    """The rendered text of the first element matching `selector` ('' if none)."""
    text: str = driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText.trim() : '';",
        selector,
    )
    return text


def attr_of(driver: WebDriver, selector: str, name: str) -> str:
    value: str = driver.execute_script(
        "const e = document.querySelector(arguments[0]);"
        " return e ? (e.getAttribute(arguments[1]) || '') : '';",
        selector,
        name,
    )
    return value


def event_kinds(driver: WebDriver) -> list[str]:
    kinds: list[str] = driver.execute_script(
        "return [...document.querySelectorAll('#events li')]"
        ".map(e => e.getAttribute('data-kind') || '');"
    )
    return kinds


def mismatches(shown: dict[str, str], stats: dict[str, Any]) -> dict[str, tuple[str, float]]:
    """Fields whose number on the page differs from the API's (hit_rate derived)."""
    asked = stats["hits"] + stats["misses"]
    want = {**stats, "hit_rate": stats["hits"] / asked if asked else None}

    def differs(shown_text: str, value: float | None) -> bool:
        if value is None:
            return shown_text != ""
        return not shown_text or abs(float(shown_text) - value) > 1e-9

    return {k: (v, want[k]) for k, v in shown.items() if differs(v, want[k])}


@pytest.mark.slow
def test_status_page_matches_the_api(cluster: Cluster, browser: WebDriver, tmp_path: Path) -> None:
    secure = {"security__token": TOKEN, "security__admin_token": ADMIN}
    # short leases keep the small memory of this test moving under the write load
    main = cluster.embedded(
        disk=True,
        slab__memory="16MiB",
        manager__write_lease="3s",
        manager__read_lease="2s",
        **secure,
    )
    url = main.manager_url
    second = cluster.start(
        ["slab", "disk"],
        {
            "slab.manager_url": url,
            "slab.memory": "16MiB",
            "security.token": TOKEN,
            "security.admin_token": ADMIN,
        },
    )
    wait_for(lambda: len(http("GET", url + "/v1/nodes", token=TOKEN)[1]["nodes"]) == 2)

    browser.get(url + "/?interval=500")
    # no token yet: the page asks for one and shows nothing else
    wait_for(lambda: browser.find_element(By.ID, "login").is_displayed())
    assert not browser.find_element(By.ID, "view").is_displayed()
    browser.find_element(By.ID, "token").send_keys("wrong")
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    wait_for(lambda: "refused" in browser.find_element(By.ID, "problem").text)
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    wait_for(lambda: browser.find_element(By.ID, "view").is_displayed())

    with Load(url) as load:
        # under load the rates come alive and the charts get points
        wait_for(
            lambda: float(attr_of(browser, "[data-rate=commits]", "data-value") or 0) > 0,
            timeout=20,
        )
        time.sleep(10)  # points on the charts, offloads and reloads
    assert not load.errors, load.errors
    assert int(attr_of(browser, "path[data-series=stores]", "data-points") or 0) >= 2

    # quiet now: the page settles on exactly what the API says
    def settled() -> bool:
        return not mismatches(page_values(browser), http("GET", url + "/v1/stats", token=TOKEN)[1])

    try:
        wait_for(settled, timeout=10)
    except AssertionError:
        raise AssertionError(
            mismatches(page_values(browser), http("GET", url + "/v1/stats", token=TOKEN)[1])
        ) from None
    truth = http("GET", url + "/v1/stats", token=TOKEN)[1]
    assert truth["commits"] >= 400 and truth["offloads"] > 0 and truth["hits"] > 0, truth
    shown = page_values(browser)
    assert {
        "nodes",
        "keys_memory",
        "keys_disk",
        "bytes_memory",
        "hits",
        "misses",
        "offloads",
        "reloads",
        "commits",
        "hit_rate",
    } <= set(shown)
    # what a person reads: formatted text of the same numbers
    card = text_of(browser, "b[data-stat=nodes]")
    assert card == "2" == str(truth["nodes"])
    assert text_of(browser, "span[data-stat=commits]") == f"{truth['commits']:,}"
    asked = truth["hits"] + truth["misses"]
    assert text_of(browser, "b[data-stat=hit_rate]") == f"{100 * truth['hits'] / asked:.1f}%"

    # nodes: both alive, memory as /v1/nodes says (it moves while freed space leaves
    # quarantine, so compare a poll apart)
    def node_rows() -> dict[str, tuple[str, str]]:
        rows: list[list[str]] = browser.execute_script(
            "return [...document.querySelectorAll('#nodes tbody tr')].map(r => ["
            " r.getAttribute('data-node') || '',"
            " (r.querySelector('.state') || {innerText: ''}).innerText.trim(),"
            " (r.querySelector('[data-field=memory_used]') || {getAttribute: () => ''})"
            ".getAttribute('data-value') || ''])"
        )
        return {node: (state, used) for node, state, used in rows}

    def nodes_match() -> bool:
        nodes = http("GET", url + "/v1/nodes", token=TOKEN)[1]["nodes"]
        return node_rows() == {n["id"]: ("alive", str(n["memory_used"])) for n in nodes}

    wait_for(nodes_match, timeout=10)
    assert len(node_rows()) == 2
    assert event_kinds(browser).count("node_joined") == 2

    # a node dies: the page says so within a poll or two
    second.kill()
    wait_for(lambda: "dead" in text_of(browser, "#nodes"), timeout=15)
    wait_for(lambda: "node_died" in event_kinds(browser), timeout=10)
    shot = tmp_path / "status-page.png"
    try:
        assert browser.save_screenshot(str(shot))
    except WebDriverException as exc:
        pytest.fail(f"screenshot failed: {exc}")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 1_000_000
    if os.environ.get("POLARKV_UPDATE_SCREENSHOT"):
        shutil.copy(shot, SCREENSHOT)


def test_page_files_are_public_and_numbers_are_not(cluster: Cluster) -> None:
    url = cluster.embedded(security__token=TOKEN, security__admin_token=ADMIN).manager_url
    status, page = http("GET", url + "/")
    assert status == 200 and 'src="static/status.js"' in page
    for name in ("status.js", "status.css"):
        assert http("GET", f"{url}/static/{name}")[0] == 200
    for path in ("/static/../app.py", "/static/nope.js", "/static/index.htm"):
        assert http("GET", url + path)[0] == 404
    assert http("GET", url + "/v1/stats")[0] == 401
    assert http("GET", url + "/v1/events")[0] == 401
    # a page from an origin that is not one of this manager's shards may not read it
    assert cors(url, "http://other:8170")["Access-Control-Allow-Origin"] is None
    # drain is an admin write: the reader token may not
    assert http("POST", url + "/v1/nodes/x/drain", {}, token=TOKEN)[0] == 403


def test_events_feed(cluster: Cluster) -> None:
    node = cluster.embedded()
    url = node.manager_url
    spec = openapi_spec()
    status, body = http("GET", url + "/v1/events")
    assert status == 200
    jsonschema.validate(
        body,
        spec["paths"]["/v1/events"]["get"]["responses"]["200"]["content"]["application/json"][
            "schema"
        ],
    )
    joined = [e for e in body["events"] if e["kind"] == "node_joined"]
    assert [e["subject"] for e in joined] == [node.info["node_id"]] and joined[0]["level"] == "info"
    assert http("GET", f"{url}/v1/events?since={body['last_seq']}")[1]["events"] == []
    for bad in ("since=x", "since=-1", "limit=0", "limit=100000"):
        status, reply = http("GET", f"{url}/v1/events?{bad}")
        assert status == 400 and "since" in reply["error"]
    status, view = http("POST", f"{url}/v1/nodes/{node.info['node_id']}/drain", {})
    assert status == 200 and view["draining"] and view["drained"]
    jsonschema.validate(
        view,
        spec["paths"]["/v1/nodes/{node_id}/drain"]["post"]["responses"]["200"]["content"][
            "application/json"
        ]["schema"],
    )
    status, nodes = http("GET", url + "/v1/nodes")
    jsonschema.validate(
        nodes,
        spec["paths"]["/v1/nodes"]["get"]["responses"]["200"]["content"]["application/json"][
            "schema"
        ],
    )
    assert nodes["nodes"][0]["draining"] is True
    kinds = [e["kind"] for e in http("GET", url + "/v1/events")[1]["events"]]
    assert kinds.count("node_draining") == 1
    http("POST", f"{url}/v1/nodes/{node.info['node_id']}/drain", {})  # again: no second event
    kinds = [e["kind"] for e in http("GET", url + "/v1/events")[1]["events"]]
    assert kinds.count("node_draining") == 1


def cors(url: str, origin: str) -> Any:
    """The headers of the CORS preflight a page from `origin` sends before reading
    `url`/v1/stats with its token."""
    req = urllib.request.Request(
        url + "/v1/stats",
        method="OPTIONS",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 204
        return resp.headers


@pytest.mark.slow
def test_one_page_over_several_shards(cluster: Cluster, browser: WebDriver) -> None:
    key = "k" * 32  # the grant key: the same on every shard and slab
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    shards = {"security__grant_key": key, "manager__shard_urls": ",".join(urls)}
    shard0 = cluster.manager(
        manager__shard="0/2", manager__listen=f"127.0.0.1:{ports[0]}", **shards
    )
    shard1 = cluster.manager(
        manager__shard="1/2", manager__listen=f"127.0.0.1:{ports[1]}", **shards
    )
    assert [shard0.manager_url, shard1.manager_url] == urls
    # each shard's page may read the other (CORS for the listed origins only)
    headers = cors(urls[1], urls[0])
    assert headers["Access-Control-Allow-Origin"] == urls[0]
    assert "Authorization" in headers["Access-Control-Allow-Headers"]
    assert cors(urls[0], "http://127.0.0.1:1")["Access-Control-Allow-Origin"] is None
    cluster.start(
        ["slab", "disk"],
        {"slab.manager_url": ",".join(urls), "slab.memory": "32MiB", "security.grant_key": key},
    )
    for url in urls:
        wait_for(
            lambda url=url: (
                [n["state"] for n in http("GET", url + "/v1/nodes")[1]["nodes"]] == ["alive"]
            )
        )
    with PolarKVClient(",".join(urls), timeout=5.0) as client:
        for i in range(24):  # keys over the whole key space: both shards get some
            key = f"{(i * 0x0B00) & 0xFFFF:04x}" + f"{i:028x}"
            assert client.put(key, bytes([i]) * 4096)
    per_shard = [http("GET", url + "/v1/stats")[1] for url in urls]
    assert all(s["keys_memory"] for s in per_shard)

    browser.get(urls[0] + "/?interval=500")  # the shards come from the manager
    wait_for(lambda: browser.find_element(By.ID, "view").is_displayed())

    def shows(field: str) -> str:
        return attr_of(browser, f"b[data-stat={field}], span[data-stat={field}]", "data-value")

    total = sum(s["keys_memory"] for s in per_shard)
    wait_for(lambda: shows("keys_memory") == str(total))
    assert total == 24 and shows("commits") == "24"
    assert shows("capacity_memory") == str(sum(s["capacity_memory"] for s in per_shard))
    assert shows("nodes") == "1"  # one node, registered with both shards
    rows = browser.execute_script(
        "return document.querySelectorAll('#shard-table tbody tr').length"
    )
    assert rows == 2 and browser.find_element(By.ID, "shard-section").is_displayed()
    assert text_of(browser, "#nodes tbody tr td:last-child") == "0,1"

    shard1.kill()  # one shard gone: the page says so and keeps showing the other
    wait_for(lambda: text_of(browser, "#problem") == "1 of 2 shard(s) unreachable")
    wait_for(lambda: shows("keys_memory") == str(per_shard[0]["keys_memory"]))
    assert "unreachable" in text_of(browser, "#shard-table")


def test_checksum_failures_are_events(cluster: Cluster) -> None:
    """A confirmed corruption is an event; a report the slab's bytes do not bear out is not."""
    url = cluster.embedded(slab__transports="tcp").manager_url
    write(url, key(6), b"y" * 4096)
    honest = post(url, "/v1/lookup", {"keys": [key(6)]})["lease"]
    post(url, "/v1/release", {"leases": [honest], "corrupt": [key(6)]})
    wait_for(lambda: http("GET", url + "/v1/stats")[1]["corrupt_reports_rejected"] == 1)
    entry, address = only(write(url, key(7), b"x" * 4096), "results")
    # the bytes go bad in the slab's memory (the writer's own grant still reaches them)
    assert raw(address, Op.WRITE, entry["grant"], b"\x00" * 4096)[0] is frames.Status.OK
    lease = post(url, "/v1/lookup", {"keys": [key(7)]})["lease"]
    post(url, "/v1/release", {"leases": [lease], "corrupt": [key(7)]})

    def failures() -> list[dict[str, Any]]:
        events = http("GET", url + "/v1/events")[1]["events"]
        return [e for e in events if e["kind"] == "checksum_failure"]

    wait_for(lambda: len(failures()) == 1)
    bad = failures()
    assert len(bad) == 1 and bad[0]["subject"] == key(7) and bad[0]["level"] == "error"
