"""End to end in real headless Chromium: start `browse` on a fixture run directory, filter wrong
answers, open a tape, open its LLM call, page to the second 100 calls, assert on what is visible.

Debian's /usr/bin/chromium driven by Playwright's Python package (no browser download).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
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
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} missing (apt-get install chromium)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_command(run: Path, port: int) -> list[str]:
    """`gsm8kctl browse` through the real CLI once it has the command, else the stage function."""
    probe = subprocess.run([sys.executable, "-m", "gsm8kctl", "browse", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    if probe.returncode == 0:
        return [sys.executable, "-m", "gsm8kctl", "browse", str(run), "--port", str(port)]
    code = f"from gsm8kctl.stages.browse import browse; browse({str(run)!r}, port={port})"
    return [sys.executable, "-c", code]


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"browse exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"browse did not answer at {url} within {timeout}s:\n{log.read_text()}")


@pytest.fixture
def server(tmp_path):
    ckpt = tmp_path / "checkpoints" / "0001"
    tok = train_tokenizer(ckpt)
    run = tmp_path / "runs" / "e2e"
    info = make_run(run, tokenizer=tok, model=str(ckpt), extra_calls=150)  # 53 tapes + 203 calls
    port = _free_port()
    log = tmp_path / "server.log"
    cmd = _server_command(run, port)
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=err, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, base + "/static/browse.css", log)
        yield {"base": base, "run": run, "info": info, "cmd": cmd, "log": log}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def test_browse_in_chromium(server, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    base = server["base"]
    tapes = server["info"]["tapes"]
    n_calls = server["info"]["n_calls"]
    n_wrong = sum(1 for t in tapes if not t["correct"] and t["finish_reason"] == "stop"
                  and t["answer"]["strict"] is not None)
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))

            # The list, then only the wrong answers.
            page.goto(base + "/")
            expect(page.locator("p.count")).to_contain_text(f"of {len(tapes)}")
            page.select_option("#outcome", "wrong")
            page.click("#apply")
            page.wait_for_url(re.compile(r"outcome=wrong"))
            expect(page.locator("p.count")).to_contain_text(f"tapes 1–{n_wrong} of {n_wrong} (filtered)")
            badges = page.locator("table.tapes tbody .badge")
            expect(badges).to_have_count(n_wrong)
            assert set(badges.all_inner_texts()) == {"wrong"}
            page.screenshot(path=str(tmp_path / "list-wrong.png"), full_page=True)

            # Open the first wrong tape.
            first = page.locator("table.tapes tbody td.id a").first
            tape_id = first.inner_text()
            first.click()
            page.wait_for_url(re.compile(r"/tapes/"))
            expect(page.locator("h1.tapeid")).to_contain_text(tape_id)
            expect(page.locator("h1.tapeid .badge")).to_have_text("wrong")
            expect(page.locator("nav.tapenav")).to_contain_text(f"1 of {n_wrong} (filtered)")
            tape = next(t for t in tapes if t["id"] == tape_id)
            expect(page.locator("pre.question")).to_have_text(tape["question"])
            expect(page.locator("pre.completion.shaded")).to_have_text(tape["steps"][1]["text"])
            assert page.locator("pre.completion.shaded span.tok.b4").count() > 0  # unlikely tokens shaded
            expect(page.locator("table.answers")).to_contain_text(tape["gold"])
            expect(page.locator("dd.reason")).to_have_text(tape["answer"]["reason"])
            expect(page.locator("table.siblings tbody tr")).to_have_count(
                sum(1 for t in tapes if (t["problem_id"], t["iteration"]) == (tape["problem_id"], tape["iteration"])))
            page.screenshot(path=str(tmp_path / "tape.png"), full_page=True)

            # j = next tape in the filtered list (the page's only script, allowed by its CSP).
            page.keyboard.press("j")
            expect(page.locator("nav.tapenav")).to_contain_text(f"2 of {n_wrong} (filtered)")
            page.keyboard.press("k")
            expect(page.locator("h1.tapeid")).to_contain_text(tape_id)

            # Its LLM call.
            page.locator("table.calls a", has_text=f"call-{tape_id}").click()
            page.wait_for_url(re.compile(r"/calls/"))
            expect(page.locator("h1")).to_contain_text(f"LLM call call-{tape_id}")
            expect(page.locator(".msg .role").first).to_have_text("system")
            expect(page.locator("main")).to_contain_text("You are a careful math tutor.")
            expect(page.locator("main")).to_contain_text('"temperature": 1.0')

            # The whole log, then its second 100 calls.
            page.click("header nav >> text=LLM calls")
            expect(page.locator("p.count")).to_contain_text(f"calls 1–100 of {n_calls}, newest first")
            expect(page.locator("table.calls tbody tr")).to_have_count(100)
            page.click("nav.pager >> text=next ›")
            page.wait_for_url(re.compile(r"page=2"))
            expect(page.locator("p.count")).to_contain_text(f"calls 101–200 of {n_calls}")
            expect(page.locator("table.calls tbody tr")).to_have_count(100)
            expect(page.locator("table.calls tbody tr").first.locator("td").first).to_have_text("101")
            page.screenshot(path=str(tmp_path / "calls-page2.png"), full_page=False)
        finally:
            browser.close()
    assert problems == []
    for name in ("list-wrong.png", "tape.png", "calls-page2.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    # Keep a copy for the README when asked (make screenshots).
    keep = os.environ.get("GSM8KCTL_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for name in ("list-wrong.png", "tape.png", "calls-page2.png"):
            shutil.copy(tmp_path / name, Path(keep) / name)
