"""End to end in real headless Chromium: start `browse` on a fixture run directory, filter wrong
answers, open a tape, open its LLM call, page to the second 100 calls, assert on what is visible.

Debian's /usr/bin/chromium driven by Playwright's Python package (no browser download).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from browse_fixtures import make_run, train_tokenizer

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(300),
]


# Generous limits: CI and the shared dev box are 2 loaded cores (vLLM, training) where a page that
# takes 50 ms idle can take seconds. Every wait below is on a condition, never a fixed sleep.
EXPECT_TIMEOUT_MS = 30_000
NAV_TIMEOUT_MS = 60_000
SERVER_START_S = 180
_URL_RE = re.compile(r"browse at (http://\S+?)/?\s")


def _server_command(run: Path) -> list[str]:
    """`gsm8kctl browse` through the real CLI once it has the command, else the stage function.

    Port 0: the server binds any free port itself and prints it, so no other process can take
    the port between our choosing it and the server binding it.
    """
    probe = subprocess.run([sys.executable, "-m", "gsm8kctl", "browse", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    if probe.returncode == 0:
        return [sys.executable, "-m", "gsm8kctl", "browse", str(run), "--port", "0"]
    code = f"from gsm8kctl.stages.browse import browse; browse({str(run)!r}, port=0)"
    return [sys.executable, "-c", code]


def _wait_ready(proc: subprocess.Popen, log: Path, n_tapes: int, timeout: float = SERVER_START_S) -> str:
    """The server's base URL once it serves the complete tape list (read from its log, then HTTP)."""
    import httpx

    deadline = time.monotonic() + timeout
    base = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"browse exited with {proc.returncode}:\n{log.read_text()}")
        if base is None:
            m = _URL_RE.search(log.read_text())
            if m:
                base = m.group(1)
        if base is not None:
            try:
                r = httpx.get(base + "/", timeout=10)
                # The index is built before the socket is bound: the first page is the whole list.
                if r.status_code == 200 and f"of {n_tapes}" in r.text:
                    return base
            except httpx.TransportError:
                pass
        time.sleep(0.2)  # poll interval, not a wait for a condition
    raise AssertionError(f"browse did not serve its tape list within {timeout}s (url {base}):\n{log.read_text()}")


def _die_with_parent() -> None:
    """In the server's child process (Linux): SIGTERM when the test process dies, so a server
    cannot outlive a killed or timed-out pytest."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(timeout=30)


@pytest.fixture
def server(tmp_path):
    ckpt = tmp_path / "checkpoints" / "0001"
    tok = train_tokenizer(ckpt)
    run = tmp_path / "runs" / "e2e"
    info = make_run(run, tokenizer=tok, model=str(ckpt), extra_calls=150)  # 53 tapes + 203 calls
    log = tmp_path / "server.log"
    cmd = _server_command(run)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    try:
        base = _wait_ready(proc, log, len(info["tapes"]))
        yield {"base": base, "run": run, "info": info, "cmd": cmd, "log": log}
    finally:
        _stop(proc)
        print(f"--- server log ({log}) ---\n{log.read_text()}")  # shown by pytest when the test fails
    assert proc.returncode is not None
    assert "Traceback" not in log.read_text(), log.read_text()


class _NetworkWatch:
    """Failed requests, HTTP errors, page errors and console errors of one page.

    A request the browser itself cancels (net::ERR_ABORTED) while the page is navigating away is
    not a failure: Chromium fetches the favicon after the load event, so going on to the next
    page (as the test does, as a user does) may cancel it, more often on a loaded machine.
    "Navigating away" = a main-frame navigation request was issued after the last load event
    (Playwright may report the favicon request itself after the next navigation's, so the test
    cannot go by the order the requests were issued in). Any other failure, an abort while no
    navigation is under way, and any response >= 400 is a problem.
    """

    def __init__(self, page):
        self.page = page
        self.problems: list[str] = []
        self.cancelled: list[str] = []
        self.navigating = False
        self.closing = False
        page.on("request", self._request)
        page.on("load", self._load)
        page.on("requestfailed", self._failed)
        page.on("response", self._response)
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}")
                if m.type == "error" else None)

    def _request(self, r) -> None:
        if r.is_navigation_request() and r.frame == self.page.main_frame:
            self.navigating = True

    def _load(self, _page) -> None:
        self.navigating = False

    def _failed(self, r) -> None:
        what = f"{r.resource_type} {r.url}: {r.failure}"
        if (r.failure == "net::ERR_ABORTED" and not r.is_navigation_request()
                and (self.navigating or self.closing)):
            self.cancelled.append(what)
        else:
            self.problems.append(f"request failed: {what}")

    def _response(self, resp) -> None:
        if resp.status >= 400:
            self.problems.append(f"HTTP {resp.status}: {resp.url}")


def test_browse_in_chromium(server, tmp_path):
    import httpx
    from playwright.sync_api import expect, sync_playwright

    base = server["base"]
    tapes = server["info"]["tapes"]
    n_calls = server["info"]["n_calls"]
    n_wrong = sum(1 for t in tapes if not t["correct"] and t["finish_reason"] == "stop"
                  and t["answer"]["strict"] is not None)
    # The favicon each page links is served (the browser may cancel its fetch when we navigate on).
    icon = httpx.get(base + "/static/favicon.svg", timeout=30)
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(EXPECT_TIMEOUT_MS)
        page.set_default_navigation_timeout(NAV_TIMEOUT_MS)
        net = _NetworkWatch(page)
        try:
            # The list, then only the wrong answers.
            page.goto(base + "/")
            expect(page.locator("p.count")).to_contain_text(f"of {len(tapes)}")
            page.select_option("#outcome", "wrong")
            page.click("#apply")
            page.wait_for_url(re.compile(r"[?&]outcome=wrong(&|$)"))
            expect(page.locator("p.count")).to_contain_text(f"tapes 1–{n_wrong} of {n_wrong} (filtered)")
            badges = page.locator("table.tapes tbody .badge")
            expect(badges).to_have_count(n_wrong)
            expect(badges).to_have_text(["wrong"] * n_wrong)
            page.screenshot(path=str(tmp_path / "list-wrong.png"), full_page=True)

            # Open the first wrong tape.
            first = page.locator("table.tapes tbody td.id a").first
            tape_id = first.inner_text()
            tape_url = base + first.get_attribute("href")
            first.click()
            page.wait_for_url(tape_url)
            expect(page.locator("h1.tapeid")).to_contain_text(tape_id)
            expect(page.locator("h1.tapeid .badge")).to_have_text("wrong")
            expect(page.locator("nav.tapenav")).to_contain_text(f"1 of {n_wrong} (filtered)")
            tape = next(t for t in tapes if t["id"] == tape_id)
            expect(page.locator("pre.question")).to_have_text(tape["question"])
            expect(page.locator("pre.completion.shaded")).to_have_text(tape["steps"][1]["text"])
            expect(page.locator("pre.completion.shaded span.tok.b4").first).to_be_visible()  # unlikely tokens shaded
            expect(page.locator("table.answers")).to_contain_text(tape["gold"])
            expect(page.locator("dd.reason")).to_have_text(tape["answer"]["reason"])
            expect(page.locator("table.siblings tbody tr")).to_have_count(
                sum(1 for t in tapes if (t["problem_id"], t["iteration"]) == (tape["problem_id"], tape["iteration"])))
            page.screenshot(path=str(tmp_path / "tape.png"), full_page=True)

            # j = next tape in the filtered list (the page's only script, allowed by its CSP).
            # wait_for_url waits for the load event, so the next page's deferred script has run
            # before the next key is pressed.
            next_url = base + page.locator('nav.tapenav a[rel="next"]').get_attribute("href")
            page.keyboard.press("j")
            page.wait_for_url(next_url)
            expect(page.locator("nav.tapenav")).to_contain_text(f"2 of {n_wrong} (filtered)")
            expect(page.locator("h1.tapeid")).not_to_contain_text(tape_id)
            page.keyboard.press("k")
            page.wait_for_url(tape_url)
            expect(page.locator("h1.tapeid")).to_contain_text(tape_id)
            expect(page.locator("nav.tapenav")).to_contain_text(f"1 of {n_wrong} (filtered)")

            # Its LLM call.
            page.locator("table.calls a", has_text=f"call-{tape_id}").click()
            page.wait_for_url(re.compile(r"/calls/call-"))
            expect(page.locator("h1")).to_contain_text(f"LLM call call-{tape_id}")
            expect(page.locator(".msg .role").first).to_have_text("system")
            expect(page.locator("main")).to_contain_text("You are a careful math tutor.")
            expect(page.locator("main")).to_contain_text('"temperature": 1.0')

            # The whole log, then its second 100 calls.
            page.click("header nav >> text=LLM calls")
            page.wait_for_url(base + "/calls")
            expect(page.locator("p.count")).to_contain_text(f"calls 1–100 of {n_calls}, newest first")
            expect(page.locator("table.calls tbody tr")).to_have_count(100)
            page.click("nav.pager >> text=next ›")
            page.wait_for_url(re.compile(r"/calls\?(.*&)?page=2(&|$)"))
            expect(page.locator("p.count")).to_contain_text(f"calls 101–200 of {n_calls}")
            expect(page.locator("table.calls tbody tr")).to_have_count(100)
            expect(page.locator("table.calls tbody tr").first.locator("td").first).to_have_text("101")
            page.screenshot(path=str(tmp_path / "calls-page2.png"), full_page=False)
        except BaseException:
            shot = tmp_path / "failure.png"
            try:
                page.screenshot(path=str(shot), full_page=True)
                print(f"failure screenshot: {shot} (page {page.url})")
            except Exception as exc:  # the browser may be gone
                print(f"no failure screenshot: {exc}")
            print("network problems so far:", net.problems, "cancelled:", net.cancelled)
            raise
        finally:
            net.closing = True
            browser.close()
            expect.set_options(timeout=5_000)
    print("requests cancelled by a later navigation:", net.cancelled)
    assert net.problems == []
    for name in ("list-wrong.png", "tape.png", "calls-page2.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    # Keep a copy for the README when asked (make screenshots).
    keep = os.environ.get("GSM8KCTL_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for name in ("list-wrong.png", "tape.png", "calls-page2.png"):
            shutil.copy(tmp_path / name, Path(keep) / name)
