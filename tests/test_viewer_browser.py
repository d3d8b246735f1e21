"""The episode viewer in a real browser: Debian's headless Chromium, driven by selenium through
chromium-driver, against a real gateway process serving a seeded records file.

What a person would check: the token is asked for and enforced, the list shows the right rows,
its filters narrow them and its pages walk them, the known episode's page shows every coordinator
turn, worker turn and tool call, thinking and long pages are folded, the loss-mask toggle shows
which tokens are trained on, a missing id is a 404 page. The episode page's screenshot is taken into
the test's temporary folder; `BCSTACK_VIEWER_SCREENSHOT=bench/results/viewer-episode.png` refreshes
the one the README shows (a run leaves the tree as it found it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import find_free_port
from stack_util import bcstack_process
from viewer_records import WORKER_TURNS, build_tokenizer, known_record, plain_record, seed_store

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# Without the background-networking flags Chromium calls home at start, which a closed network refuses.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1000",
)
TOKEN = "viewer-secret"
KNOWN = "known-episode"
T0 = 1_790_000_000.0
DAY = 86_400.0
# Where the episode page's screenshot goes besides the test's temporary folder (unset: nowhere).
SCREENSHOT = os.environ.get("BCSTACK_VIEWER_SCREENSHOT")

# The seeded list: the known episode and eleven plain ones (status, group, weight version, verdict, day).
PLAIN = [
    ("p00", "finish", "g-1", ("v1",), True, 0),
    ("p01", "finish", "g-1", ("v1",), False, 0),
    ("p02", "error", "g-1", ("v1",), None, 0),
    ("p03", "finish", "g-1", ("v2",), True, 1),
    ("p04", "finish", "g-2", ("v2",), None, 1),
    ("p05", "error", "g-2", ("v2",), None, 1),
    ("p06", "turns", "g-2", ("v2",), False, 1),
    ("p07", "finish", "g-2", ("v2",), True, 2),
    ("p08", "finish", "g-2", ("v2",), True, 2),
    ("p09", "error", "g-1", ("v2",), None, 2),
    ("p10", "finish", "g-1", ("v2",), False, 2),
]
ROWS = len(PLAIN) + 1


def _expected(predicate) -> int:
    return sum(1 for row in PLAIN if predicate(*row[1:]))


def _chromium(profile: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def _seed(root: Path) -> tuple[Path, Path]:
    """The tokenizer folder and the records file: the known episode and the PLAIN ones."""
    from tokenizers import Tokenizer

    tokenizer_dir = build_tokenizer(root / "tokenizer")
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    known = known_record(
        lambda t: tokenizer.encode(t, add_special_tokens=False).ids, KNOWN, created_at=T0 + 3 * DAY
    )
    plain = [
        plain_record(i, status=s, group_id=g, weight_versions=v, correct=c, created_at=T0 + d * DAY + n)
        for n, (i, s, g, v, c, d) in enumerate(PLAIN)
    ]
    return tokenizer_dir, seed_store(root / "records.sqlite", [*plain, known])


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, object, Path]]:
    """A gateway process on the seeded records, and a headless Chromium that has been given the viewer
    token once (the link a colleague is sent; a cookie from then on). Both start at once."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail(
            "no headless Chromium (Debian packages `chromium`, `chromium-driver`): run `make install-test`"
        )
    root = tmp_path_factory.mktemp("viewer-browser")
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(1) as pool:
        profile = stack.enter_context(tempfile.TemporaryDirectory(prefix="viewer-chromium-"))
        starting = pool.submit(_chromium, profile)
        stack.callback(lambda: starting.result().quit())
        tokenizer_dir, records = _seed(root)
        port = find_free_port()
        args = [
            "serve", "coordinator", "--port", str(port), "--grpc-port", str(find_free_port()),
            "--records", str(records), "--tokenizer", str(tokenizer_dir),
            "--coordinator-url", "http://127.0.0.1:9/v1",
        ]  # fmt: skip
        env = {"BCSTACK_COORDINATOR_VIEWER_TOKEN": TOKEN}
        stack.enter_context(bcstack_process(args, f"http://127.0.0.1:{port}/health", env=env))
        gateway, driver = f"http://127.0.0.1:{port}", starting.result()
        driver.get(f"{gateway}/ui?token={TOKEN}")
        yield gateway, driver, tokenizer_dir


@pytest.fixture
def gateway(served) -> str:
    return served[0]


@pytest.fixture
def browser(served):
    return served[1]


def _by_css(driver, selector: str) -> list:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def _one(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def _follow(driver, selector: str) -> None:
    """Click the link or button SELECTOR and wait for the page it loads: a click returns before the
    next page is there, and on a slow machine the old page would still be read."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    old = _one(driver, "html")
    _one(driver, selector).click()

    def gone(_driver) -> bool:
        # selenium's `staleness_of` waits for a StaleElementReferenceException alone; Chromium 156 may
        # answer a node of the unloaded page with "Node with given id does not belong to the document"
        # (an "unknown error"), which means the same and failed this wait once in `make test`.
        try:
            old.is_enabled()
        except StaleElementReferenceException:
            return True
        except WebDriverException as exc:
            if "does not belong to the document" in str(exc.msg):
                return True
            raise
        return False

    WebDriverWait(driver, 20).until(gone)


def _rows(driver) -> list[str]:
    """The episode ids the list shows, in order (one round trip to the browser, not one per row)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('tr.episode-row td a'), a => a.textContent)"
    )


def test_the_token_is_asked_for_once_and_enforced(gateway: str, browser) -> None:
    browser.delete_all_cookies()
    try:
        _the_token_is_asked_for_once_and_enforced(gateway, browser)
    finally:  # the other tests use the browser's cookie: give it back whatever happened here
        browser.get(f"{gateway}/ui?token={TOKEN}")


def _the_token_is_asked_for_once_and_enforced(gateway: str, browser) -> None:
    browser.get(f"{gateway}/ui")
    assert _one(browser, "#message h1").text == "Token required" and _rows(browser) == []
    _one(browser, "input[name=token]").send_keys("not-the-token")
    _follow(browser, ".token-form button")
    assert _one(browser, "#message h1").text == "Wrong token"
    _one(browser, "input[name=token]").send_keys(TOKEN)
    _follow(browser, ".token-form button")
    assert len(_rows(browser)) == ROWS and "token" not in browser.current_url
    cookie = browser.get_cookie("bcstack_viewer")
    assert cookie["httpOnly"] and TOKEN not in cookie["value"]
    assert "bcstack_viewer" not in browser.execute_script("return document.cookie")  # out of scripts' reach
    # and without the browser's cookie: nothing
    assert httpx.get(f"{gateway}/ui/episodes/{KNOWN}").status_code == 401
    assert httpx.get(f"{gateway}/ui", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_the_list_shows_every_episode_and_the_filters_narrow_it(gateway: str, browser) -> None:
    from selenium.webdriver.support.ui import Select

    browser.get(f"{gateway}/ui")
    assert len(_rows(browser)) == ROWS and _rows(browser)[0] == KNOWN  # newest first
    assert _one(browser, "#count").text == f"1–{ROWS} of {ROWS} episodes"
    Select(_one(browser, "select[name=status]")).select_by_visible_text("error")
    _follow(browser, "#filters button")
    assert len(_rows(browser)) == _expected(lambda s, g, v, c, d: s == "error")
    _one(browser, "input[name=group_id]").send_keys("g-2")
    _follow(browser, "#filters button")
    assert len(_rows(browser)) == _expected(lambda s, g, v, c, d: s == "error" and g == "g-2")
    assert Select(_one(browser, "select[name=status]")).first_selected_option.text == "error"  # kept

    for query, expected in [
        ("weight_version=v1", _expected(lambda s, g, v, c, d: "v1" in v)),
        ("graded=correct", _expected(lambda s, g, v, c, d: c is True) + 1),  # + the known episode
        ("graded=incorrect", _expected(lambda s, g, v, c, d: c is False)),
        ("question_id=q-1761", 1),
        ("since=2026-09-22&until=2026-09-22", _expected(lambda s, g, v, c, d: d == 1)),
        ("endpoint=default&status=finish", _expected(lambda s, g, v, c, d: s == "finish") + 1),
    ]:
        browser.get(f"{gateway}/ui?{query}")
        assert len(_rows(browser)) == expected, query
    browser.get(f"{gateway}/ui?since=someday")
    assert "since" in _one(browser, ".filter-error").text and len(_rows(browser)) == ROWS


def test_paging_walks_the_list(gateway: str, browser) -> None:
    browser.get(f"{gateway}/ui?per_page=5")
    pages = [_rows(browser)]
    assert _by_css(browser, "#prev-page") == [] and _one(browser, "#page-of").text == "page 1 of 3"
    while _by_css(browser, "#next-page"):
        _follow(browser, "#next-page")
        pages.append(_rows(browser))
    assert [len(p) for p in pages] == [5, 5, ROWS - 10]
    seen = [episode for page in pages for episode in page]
    assert len(set(seen)) == ROWS
    _follow(browser, "#prev-page")
    assert _rows(browser) == pages[1]


def test_the_episode_page_shows_every_turn_and_tool_call(gateway: str, browser) -> None:
    browser.get(f"{gateway}/ui")
    _follow(browser, f"a[href$='/ui/episodes/{KNOWN}']")
    assert _one(browser, "#episode-id").text == KNOWN and _one(browser, "#gold-answer").text == "1761"
    assert (
        _one(browser, "#verdict").text == "correct"
        and "contribution 0.75" in _one(browser, ".branch h3").text
    )
    assert len(_by_css(browser, "section.coordinator-turn")) == 2
    turns = _by_css(browser, "li.worker-turn")
    assert len(turns) == len(WORKER_TURNS)
    assert [t.find_element("css selector", ".weight-version").text for t in turns] == ["v3", "v4", "v4", "v4"]
    calls = [c.text for c in _by_css(browser, "li.tool-call")]
    assert [c.split(" → ")[0] for c in calls] == [
        "search(query='Boshin Library of Letters', topk='5')",
        "open_page(docid='3302')",
        "open_page(docid='99999')",
        "finish(answer='1761', explanation='Founded in 1761 [3302].', confidence='90%')",
    ]
    assert "not_found" in calls[2]
    for turn, expected in zip(turns, WORKER_TURNS, strict=True):
        assert expected.call.splitlines()[0] in turn.find_element("css selector", ".model-text").text
        thinking = turn.find_element("css selector", "details.thinking")
        assert not thinking.find_element("css selector", "pre").is_displayed()  # folded until opened
    thinking = turns[0].find_element("css selector", "details.thinking")
    thinking.find_element("css selector", "summary").click()
    assert thinking.find_element("css selector", "pre").text == WORKER_TURNS[0].thinking
    # the opened page is long: folded; the search results are short: shown
    assert turns[1].find_elements("css selector", ".observation details.fold")
    assert "founded in 1761" in turns[0].find_element("css selector", ".observation pre").text
    bars = {b.find_element("css selector", ".bar-label").text: b for b in _by_css(browser, ".branch .bar")}
    assert (
        bars["tokens"].get_attribute("data-limit") == "24576"
        and bars["turns"].get_attribute("data-used") == "4"
    )


def test_the_mask_toggle_shows_what_is_trained_on(gateway: str, browser, tmp_path: Path) -> None:
    browser.get(f"{gateway}/ui/episodes/{KNOWN}")
    mask = _one(browser, ".mask-view")
    toggle = _one(browser, "#mask-toggle")
    assert not mask.is_displayed() and toggle.get_attribute("aria-pressed") == "false"
    toggle.click()
    assert mask.is_displayed() and toggle.get_attribute("aria-pressed") == "true"
    trained = _by_css(browser, ".seg.m1")
    assert len(trained) == len(WORKER_TURNS) and all(s.is_displayed() for s in trained)
    untrained = _by_css(browser, "span.seg.m0")
    assert trained[0].value_of_css_property("background-color") != untrained[0].value_of_css_property(
        "background-color"
    )
    assert WORKER_TURNS[0].thinking in trained[0].text
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1280, min(height + 40, 4000))
    shot = tmp_path / "viewer-episode.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if SCREENSHOT:
        Path(SCREENSHOT).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)
    browser.set_window_size(1280, 1000)
    toggle.click()
    assert not mask.is_displayed()


def test_a_missing_episode_is_a_404_page(gateway: str, browser) -> None:
    browser.get(f"{gateway}/ui/episodes/no-such-episode")
    assert _one(browser, "#message h1").text == "No such episode" and "no-such-episode" in browser.page_source
    missing = httpx.get(
        f"{gateway}/ui/episodes/no-such-episode", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert missing.status_code == 404 and missing.headers["content-type"].startswith("text/html")


def test_the_terminal_shows_the_same_episode_from_a_stacks_state(served, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from bcstack.cli import app

    gateway, _, tokenizer_dir = served
    state = tmp_path / "state"
    state.mkdir()
    (state / "stack.json").write_text(
        json.dumps({"assets": {"tiny": str(tokenizer_dir)}, "services": {"coordinator": {"http": gateway}}})
    )
    shown = CliRunner().invoke(
        app, ["episodes", "show", KNOWN, "--state", str(state)], env={"COLUMNS": "200"}
    )
    assert shown.exit_code == 0, shown.output
    assert all(turn.thinking in shown.output for turn in WORKER_TURNS) and "judge: correct" in shown.output
    missing = CliRunner().invoke(app, ["episodes", "show", "no-such-episode", "--gateway", gateway])
    assert missing.exit_code == 1
    assert missing.output.strip() == f"error: no recorded episode 'no-such-episode' at {gateway}"
