"""The web dashboard in a real browser (issue 20): Debian's chromium, headless, driven by Playwright (never a
downloaded browser), against the session's real `shoal serve` with real container sandboxes.

The list shows a project's sandboxes and nothing of another project's, filters work, a terminal types a
command and reads its output, close from the UI removes the sandbox. Screenshots of the main pages are
written to docs/img/ui-*.png (kept in the repository)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import shoal
from shoal.errors import SandboxNotFound

pytestmark = [pytest.mark.root, pytest.mark.slow]
CHROMIUM = "/usr/bin/chromium"
IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
# as root, chromium needs --no-sandbox; the rest keeps it off the network (this machine has none but loopback)
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic", "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def browser() -> Iterator:
    """A headless chromium from Debian's package, with a fresh profile; closed at the end."""
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            raise RuntimeError("chromium is missing: scripts/setup.sh installs it")
        pytest.skip("Debian's chromium is not installed (make setup)")
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="shoal-chromium-")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True, args=ARGS,
                                                   viewport={"width": 1400, "height": 900})
        try:
            yield ctx
        finally:
            ctx.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def tokens(api_server) -> dict[str, str]:
    from shoal.server.tokens import TokenStore

    store = TokenStore(Path(os.environ["SHOAL_HOME"]))
    return {"alpha": store.create("dash-alpha", name="dashboard test"),
            "beta": store.create("dash-beta", name="dashboard test"),
            "admin": store.create("dash-ops", admin=True, name="dashboard test")}


def _login(page, url: str, token: str) -> None:
    page.goto(url + "/ui#/overview")
    page.evaluate("sessionStorage.clear()")
    page.reload()  # signed out: the page asks for a token
    page.wait_for_selector("#loginform")
    page.fill("#token", token)
    page.click("#loginform button")
    page.wait_for_function("document.querySelector('#who').textContent.length > 0")


def _rows(page) -> list[str]:
    return page.eval_on_selector_all("#sandboxes tbody tr", "rs => rs.map(r => r.dataset.id)")


def _wait_rows(page, n: int) -> list[str]:
    page.wait_for_function(f"document.querySelectorAll('#sandboxes tbody tr').length === {n}", timeout=20_000)
    return _rows(page)


def test_the_dashboard_lists_filters_opens_a_terminal_and_closes(api_server, tokens, browser) -> None:
    url = api_server.url
    alpha = shoal.SyncClient(url, token=tokens["alpha"])
    beta = shoal.SyncClient(url, token=tokens["beta"])
    made = []
    try:
        train = [alpha.create("base", labels={"shoal.job": "train", "step": str(i)}) for i in range(2)]
        ev = alpha.create("base", labels={"shoal.job": "eval"})
        other = beta.create("base", labels={"shoal.job": "train"})
        made = [*train, ev, other]
        assert train[0].exec("echo hello; exit 3").exit_code == 3
        train[1].pause()
        ids = {s.id for s in (*train, ev)}

        page = browser.new_page()
        dialogs: list[str] = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.accept()))
        _login(page, url, tokens["alpha"])

        # the list: exactly this project's three sandboxes
        page.goto(url + "/ui#/sandboxes")
        assert set(_wait_rows(page, 3)) == ids
        assert other.id not in page.content()
        page.screenshot(path=str(IMG / "ui-sandboxes.png"), full_page=True)

        # filters: by state, by job, by label
        page.select_option("select[name=state]", "paused")
        page.click("#filters button[type=submit]")
        assert _wait_rows(page, 1) == [train[1].id]
        page.goto(url + "/ui#/sandboxes?job=eval")
        assert _wait_rows(page, 1) == [ev.id]
        page.goto(url + "/ui#/sandboxes?label=step%3D0")
        assert _wait_rows(page, 1) == [train[0].id]

        # details: its command with the exit code, its events; then a live terminal
        page.goto(url + f"/ui#/sandbox/{train[0].id}")
        page.wait_for_selector("table.commands")
        cmds = page.inner_text("table.commands")
        assert "echo hello; exit 3" in cmds and "\t3\t" in cmds.replace("\n", "\t")
        page.wait_for_selector("table.events")
        assert "created" in page.inner_text("table.events")
        page.click("#a-term")
        page.wait_for_selector(".xterm-helper-textarea")
        page.wait_for_function("document.querySelector('.xterm-rows') && "
                               "/[#$] *$/m.test(document.querySelector('.xterm-rows').innerText)", timeout=30_000)
        page.focus(".xterm-helper-textarea")
        page.keyboard.type("echo shoal-$((6*7)) > /tmp/from-ui; cat /tmp/from-ui\n")
        page.wait_for_function("document.querySelector('.xterm-rows').innerText.includes('shoal-42')",
                               timeout=30_000)
        assert train[0].read_file("/tmp/from-ui") == b"shoal-42\n"  # typed into the real sandbox
        page.screenshot(path=str(IMG / "ui-sandbox.png"), full_page=True)

        # close from the UI (with its confirmation): gone from the list and from the API
        page.click("#a-close")
        page.wait_for_function("location.hash === '#/sandboxes'")
        remaining = _wait_rows(page, 2)
        assert train[0].id not in remaining and any("Close" in m for m in dialogs)
        with pytest.raises(SandboxNotFound):
            alpha.get(train[0].id)

        # another project's token sees nothing of this one: list, events, a direct link
        _login(page, url, tokens["beta"])
        page.goto(url + "/ui#/sandboxes")
        assert _wait_rows(page, 1) == [other.id]
        page.goto(url + "/ui#/events")
        page.wait_for_selector("table.events")
        text = page.inner_text("#evs")
        assert other.id in text and not any(i in text for i in ids)
        page.goto(url + f"/ui#/sandbox/{ev.id}")
        page.wait_for_timeout(1500)
        assert "eval" not in page.inner_text("#main") and "created" not in page.inner_text("#main")

        # the admin: nodes, live charts, images with their users, events of everyone
        _login(page, url, tokens["admin"])
        page.goto(url + "/ui#/overview")
        page.wait_for_selector("#nodeswrap table")
        page.wait_for_function("document.querySelector('#cards').innerText.includes('RUNNING') || "
                               "document.querySelector('#cards').innerText.toLowerCase().includes('running')")
        page.wait_for_timeout(4500)  # two more samples for the charts
        assert re.search(r"\bok\b", page.inner_text("#nodeswrap"))
        page.screenshot(path=str(IMG / "ui-overview.png"), full_page=True)
        page.goto(url + "/ui#/images")
        page.wait_for_selector("#images")
        assert "base" in page.inner_text("#images")
        page.screenshot(path=str(IMG / "ui-images.png"))
        page.goto(url + "/ui#/events")
        page.wait_for_selector("table.events")
        assert train[0].id in page.inner_text("#evs")  # its `closed` event
        page.screenshot(path=str(IMG / "ui-events.png"))
        page.close()
    finally:
        for sb in made:
            try:
                sb.close()
            except SandboxNotFound:
                pass
        alpha.close()
        beta.close()
