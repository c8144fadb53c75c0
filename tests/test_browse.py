"""HTTP tests of the tape browser: every route, filters, paging edges, 400/404, XSS, traversal.

Fixture run directories are generated in tmp dirs by `browse_fixtures` (no model involved).
"""

from __future__ import annotations

import asyncio
import hashlib
import html
import json
import re
import sqlite3
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from browse_fixtures import XSS, fake_tape, make_run, train_tokenizer, write_jsonl
from gsm8kctl.artifacts.tapes import outcome
from gsm8kctl.browse.app import create_app
from gsm8kctl.browse.calls import MAX_PARENTS, find_llm_calls
from gsm8kctl.browse.index import Filters, TapeIndex, _parse_head, discover_tape_files
from gsm8kctl.browse.tokens import bucket, shaded_pieces, token_spans
from gsm8kctl.errors import UserError

BASE = "http://127.0.0.1"
ID_RE = re.compile(r'<td class="id"><a href="/tapes/[^"]*">([^<]*)</a>')
CALL_RE = re.compile(r'<td class="id"><a href="/calls/[^"]*">([^<]*)</a>')


def listed(text: str) -> list[str]:
    return [html.unescape(m) for m in ID_RE.findall(text)]


def listed_calls(text: str) -> list[str]:
    return [html.unescape(m) for m in CALL_RE.findall(text)]


def all_listed(client: TestClient, query: str = "") -> list[str]:
    r = client.get(f"/?per_page=500&{query}")
    assert r.status_code == 200, r.text
    return listed(r.text)


def file_order(root: Path) -> list[dict]:
    tapes = []
    for p in discover_tape_files(root):
        tapes += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return tapes


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A run with 2 iterations x 6 problems x 4 attempts, an eval, 203 calls, a tokenizer, and
    hostile tapes (XSS in every text field, odd ids)."""
    base = tmp_path_factory.mktemp("site")
    ckpt = base / "checkpoints" / "0001"
    tok = train_tokenizer(ckpt)
    run = base / "runs" / "r1"
    info = make_run(run, tokenizer=tok, model=str(ckpt), extra_calls=150)
    rng = __import__("random").Random(5)
    evil = fake_tape(iteration=1, split="train", problem_index=99, attempt=0, outcome="wrong", rng=rng,
                     tokenizer=tok, model=str(ckpt), completion="Step 1: " + XSS + "\n\\boxed{7}",
                     question="What is " + XSS + "?")
    evil["id"] = "evil-<script>alert(1)</script>"
    evil["gold"] = XSS
    evil["answer"]["reason"] = XSS
    evil["steps"].append({"kind": "tool_call<script>", "payload": XSS})
    odd = fake_tape(iteration=1, split="train", problem_index=98, attempt=0, outcome="correct", rng=rng)
    odd["id"] = "odd/id with spaces & ünïcode?#"
    odd["model"] = "no/such/model-dir"
    path = run / "iterations" / "0001" / "tapes.jsonl"
    with open(path, "a", encoding="utf-8") as f:
        for t in (evil, odd):
            f.write(json.dumps(t, ensure_ascii=False) + "\n")
    from gsm8kctl.artifacts.llm_calls import call_record, insert_calls, open_log

    db = open_log(run / "llm_calls.sqlite")
    insert_calls(db, [call_record(
        call_id="call-evil", tape_id=evil["id"], backend="transformers", model="m<script>",
        messages=[{"role": "user<script>", "content": XSS}], prompt_text=XSS, completion=XSS,
        params={"x": XSS}, prompt_tokens=1, completion_tokens=2, latency_s=0.1, finish_reason="stop",
        created=1.5e9)])
    db.conn.close()
    app = create_app(run)
    with TestClient(app, base_url=BASE) as client:
        yield {"client": client, "run": run, "tapes": file_order(run), "n_calls": info["n_calls"] + 1,
               "evil": evil, "odd": odd, "app": app, "ckpt": ckpt, "tok": tok}


# ---------------------------------------------------------------------------------------------
# Tape list: paging, filters, sort


def test_list_first_page_in_file_order(site):
    r = site["client"].get("/")
    assert r.status_code == 200
    n = len(site["tapes"])
    assert f"tapes 1–50 of {n}" in r.text
    assert listed(r.text) == [t["id"] for t in site["tapes"][:50]]
    # Iteration 0's training tapes first, evaluation after its iteration's training tapes.
    assert site["tapes"][0]["iteration"] == 0 and site["tapes"][-1]["split"] == "test"


def test_paging_edges(site):
    c, tapes = site["client"], site["tapes"]
    n = len(tapes)
    r = c.get("/?per_page=10&page=2")
    assert listed(r.text) == [t["id"] for t in tapes[10:20]]
    assert 'rel="prev"' in r.text and 'rel="next"' in r.text
    last = (n + 9) // 10
    r = c.get(f"/?per_page=10&page={last}")
    assert listed(r.text) == [t["id"] for t in tapes[(last - 1) * 10:]]
    assert 'rel="next"' not in r.text and f"page {last} of {last}" in r.text
    r = c.get(f"/?per_page=10&page={last + 1}")
    assert r.status_code == 200 and listed(r.text) == []
    assert "past the end" in r.text
    r = c.get("/?per_page=500")
    assert len(listed(r.text)) == n and 'rel="next"' not in r.text and 'rel="prev"' not in r.text
    r = c.get("/?page=1")
    assert 'rel="prev"' not in r.text
    # Links keep the filters.
    r = c.get("/?outcome=wrong&per_page=5")
    assert "/?outcome=wrong&amp;per_page=5&amp;page=2" in r.text


@pytest.mark.parametrize("query", [
    "page=0", "page=-1", "page=abc", "page=1.5", "page=" + "9" * 20, "per_page=0", "per_page=501", "per_page=x",
    "iteration=x", "iteration=-1", "iteration=" + "9" * 20, "outcome=bogus", "sort=bogus", "sort=reward;DROP TABLE tapes",
    "reward=abc", "reward=nan", "reward=inf", "file=99", "file=-1", "q=" + "x" * 201, "split=" + "s" * 400,
])
def test_bad_query_params_are_400(site, query):
    r = site["client"].get("/?" + query)
    assert r.status_code == 400
    assert "query parameter" in r.text
    # Tape and calls pages validate the same way.
    tid = site["tapes"][0]["id"]
    assert site["client"].get(f"/tapes/{tid}?{query}").status_code == 400


def test_calls_bad_params_are_400(site):
    c = site["client"]
    for q in ("page=0", "page=x", "page=-3", "page=" + "9" * 20, "tape=" + "t" * 400):
        assert c.get("/calls?" + q).status_code == 400


def test_huge_page_is_400_not_an_overflow(site):
    """SQLite's integers are 64-bit: a page number past them was an OverflowError, a 500."""
    c = site["client"]
    for url in ("/?page=1000000001", "/calls?page=1000000001", "/?page=" + "9" * 20, "/calls?page=" + "9" * 20):
        r = c.get(url)
        assert r.status_code == 400 and "query parameter &#39;page&#39;: out of range 1..1000000000" in r.text, url
    r = c.get("/?page=1000000000")  # the largest page taken is only past the end
    assert r.status_code == 200 and "past the end" in r.text
    assert c.get("/calls?page=1000000000").status_code == 200


@pytest.mark.parametrize("oc", ["correct", "wrong", "unparsable", "overflow"])
def test_filter_by_outcome(site, oc):
    expected = [t["id"] for t in site["tapes"] if outcome(t) == oc]
    assert expected
    assert all_listed(site["client"], f"outcome={oc}") == expected


def test_filters_iteration_split_reward_problem_file_and_combined(site):
    c, tapes = site["client"], site["tapes"]
    assert all_listed(c, "iteration=1") == [t["id"] for t in tapes if t["iteration"] == 1]
    assert all_listed(c, "split=test") == [t["id"] for t in tapes if t["split"] == "test"]
    assert all_listed(c, "reward=-1") == [t["id"] for t in tapes if t["reward"] == -1.0]
    assert all_listed(c, "reward=1.0") == [t["id"] for t in tapes if t["reward"] == 1.0]
    assert all_listed(c, "problem=train-00003") == [t["id"] for t in tapes if t["problem_id"] == "train-00003"]
    assert all_listed(c, "iteration=1&split=train&outcome=wrong") == [
        t["id"] for t in tapes if t["iteration"] == 1 and t["split"] == "train" and outcome(t) == "wrong"]
    files = discover_tape_files(site["run"])
    second = [json.loads(line)["id"] for line in files[1].read_text().splitlines()]
    assert all_listed(c, "file=1") == second
    # Empty fields (what the form submits) mean "no filter".
    assert all_listed(c, "iteration=&split=&outcome=&reward=&problem=&q=&sort=") == [t["id"] for t in tapes]
    assert all_listed(c, "problem=no-such-problem") == []
    assert "no tapes match" in c.get("/?problem=no-such-problem").text


def test_text_search_in_question_and_completion_case_insensitive(site):
    c, tapes = site["client"], site["tapes"]
    # In completions only (overflowing tapes repeat this sentence).
    want = [t["id"] for t in tapes if "recompute this again" in t["steps"][1]["text"].lower()]
    assert want and all_listed(c, "q=RECOMPUTE+this+AGAIN") == want
    # In questions.
    want = [t["id"] for t in tapes if "babysitting" in t["question"].lower()]
    assert want and all_listed(c, "q=Babysitting") == want
    # Markup characters are searched literally (substring, not a tokenized full-text query).
    want = [t["id"] for t in tapes if "\\boxed{72}" in t["steps"][1]["text"]]
    assert want and all_listed(c, "q=%5Cboxed%7B72%7D") == want
    assert all_listed(c, "q=boxed&outcome=correct") == [
        t["id"] for t in tapes if "boxed" in t["steps"][1]["text"].lower() and outcome(t) == "correct"]
    # SQL / LIKE metacharacters are plain text.
    assert all_listed(c, "q=%25") == [t["id"] for t in tapes if "%" in (t["question"] + t["steps"][1]["text"])]
    assert all_listed(c, "q=' OR 1=1 --") == []


def _key_order(tapes, key, reverse=False):
    indexed = list(enumerate(tapes))
    return [t["id"] for _, t in sorted(indexed, key=lambda it: (key(it[1]), it[0]), reverse=reverse)]


def test_sorts(site):
    c, tapes = site["client"], site["tapes"]
    assert all_listed(c, "sort=reward") == _key_order(tapes, lambda t: t["reward"])
    assert all_listed(c, "sort=-reward") == _key_order(tapes, lambda t: t["reward"], reverse=True)
    n_tok = lambda t: (len(t["completion_token_ids"]), len(t["steps"][1]["text"]))  # noqa: E731
    assert all_listed(c, "sort=length") == _key_order(tapes, n_tok)
    assert all_listed(c, "sort=-length") == _key_order(tapes, n_tok, reverse=True)
    prob = lambda t: (t["problem_id"], t["iteration"], t["attempt"])  # noqa: E731
    assert all_listed(c, "sort=problem") == _key_order(tapes, prob)
    assert all_listed(c, "sort=-file") == [t["id"] for t in reversed(tapes)]
    wrong_long = [t for t in tapes if outcome(t) == "wrong"]
    assert all_listed(c, "outcome=wrong&sort=-length") == _key_order(wrong_long, n_tok, reverse=True)


def test_sql_injection_in_params_is_inert(site):
    c = site["client"]
    assert all_listed(c, "problem=' OR '1'='1") == []
    assert all_listed(c, "split=train' --") == []
    r = c.get("/calls?tape=' OR '1'='1")
    assert r.status_code == 200 and listed_calls(r.text) == []


# ---------------------------------------------------------------------------------------------
# Tape view


def test_tape_view_shows_everything(site):
    c, tapes = site["client"], site["tapes"]
    t = next(t for t in tapes if outcome(t) == "wrong" and t["iteration"] == 0)
    r = c.get(f"/tapes/{t['id']}")
    assert r.status_code == 200
    text = html.unescape(r.text)
    assert t["question"] in text
    assert f"gold</th><td class=\"mono\">{t['gold']}" in text
    assert t["answer"]["reason"] in text
    assert f"prompt {len(t['prompt_token_ids'])} · completion {len(t['completion_token_ids'])}" in text
    assert "finish</dt><dd class=\"\">stop" in text
    assert 'class="badge wrong"' in r.text
    # Completion shaded token by token (the checkpoint's tokenizer.json was found from `model`).
    pieces = re.findall(r'<span class="tok b(\d)" title="([^"]*)">([^<]*)</span>', r.text)
    assert "".join(html.unescape(p[2]) for p in pieces) == t["steps"][1]["text"]
    assert {p[0] for p in pieces} >= {"0", "4"}  # confident and unlikely tokens both shaded
    assert "logprob=" in pieces[0][1]
    # Siblings: every attempt at the problem in this iteration, this one marked.
    sib = [s["id"] for s in tapes if (s["problem_id"], s["iteration"], s["split"]) ==
           (t["problem_id"], t["iteration"], t["split"])]
    sib_section = r.text.split("Attempts at this problem")[1].split("LLM calls")[0]
    assert [x for x in sib if x != t["id"]] == listed(sib_section)
    assert f"{t['id']} (this)" in sib_section
    # Its LLM call, linked.
    assert f'href="/calls/call-{t["id"]}"' in r.text
    # Raw JSON.
    raw = c.get(f"/raw/{t['id']}")
    assert raw.status_code == 200 and raw.json() == t
    assert raw.headers["content-type"].startswith("application/json")


def test_prev_next_walk_the_filtered_sorted_list(site):
    c = site["client"]
    query = "outcome=wrong&sort=-length"
    expected = all_listed(c, query)
    walked = [expected[0]]
    r = c.get(f"/tapes/{expected[0]}?{query}")
    assert 'rel="prev"' not in r.text and f"1 of {len(expected)} (filtered)" in r.text
    while True:
        m = re.search(r'<a href="/tapes/([^"?]*)\?([^"]*)" rel="next"', r.text)
        if not m:
            break
        from urllib.parse import unquote

        walked.append(unquote(m.group(1)))
        assert html.unescape(m.group(2)) == query
        r = c.get(f"/tapes/{m.group(1)}?{query}")
    assert walked == expected
    assert f"{len(expected)} of {len(expected)}" in r.text
    # Backwards from the last one.
    m = re.search(r'<a href="/tapes/([^"?]*)\?[^"]*" rel="prev"', r.text)
    from urllib.parse import unquote

    assert unquote(m.group(1)) == expected[-2]


def test_tape_outside_the_filter_still_has_neighbours(site):
    c, tapes = site["client"], site["tapes"]
    t = next(t for t in tapes if outcome(t) == "correct")
    r = c.get(f"/tapes/{t['id']}?outcome=wrong")
    assert r.status_code == 200 and "not in the current list" in r.text
    nxt = re.search(r'<a href="/tapes/([^"?]*)\?[^"]*" rel="next"', r.text)
    later_wrong = [x["id"] for x in tapes[tapes.index(t):] if outcome(x) == "wrong"]
    assert nxt and nxt.group(1) == later_wrong[0]


def test_tape_without_a_tokenizer_falls_back_to_plain_text_and_a_logprob_strip(site):
    odd = site["odd"]
    r = site["client"].get("/tapes/" + __import__("urllib.parse").parse.quote(odd["id"], safe=""))
    assert r.status_code == 200
    assert 'class="tok b' not in r.text.split("Completion</h2>")[1].split("</section>")[0]
    assert f'<pre class="text completion">{odd["steps"][1]["text"]}</pre>' in html.unescape(r.text)
    assert r.text.count('class="cell b') == len(odd["logprobs"])
    assert "no tokenizer found for model no/such/model-dir" in r.text


def test_unknown_ids_and_routes_are_404(site):
    c = site["client"]
    for url in ("/tapes/no-such-tape", "/raw/no-such-tape", "/calls/no-such-call", "/nope", "/tapes/",
                "/static/nope.css"):
        r = c.get(url)
        assert r.status_code == 404, url
    assert "no tape with id" in c.get("/tapes/no-such-tape").text


# ---------------------------------------------------------------------------------------------
# LLM calls


def test_calls_pages_100_at_a_time_newest_first(site):
    c, n = site["client"], site["n_calls"]
    con = sqlite3.connect(site["run"] / "llm_calls.sqlite")
    newest_first = [r[0] for r in con.execute("SELECT id FROM llm_calls ORDER BY created DESC, rowid DESC")]
    con.close()
    assert n == len(newest_first) > 200
    r1 = c.get("/calls")
    assert listed_calls(r1.text) == newest_first[:100]
    assert f"calls 1–100 of {n}" in r1.text and 'href="/calls?page=2"' in r1.text
    r2 = c.get("/calls?page=2")
    assert listed_calls(r2.text) == newest_first[100:200] and f"calls 101–200 of {n}" in r2.text
    r3 = c.get("/calls?page=3")
    assert listed_calls(r3.text) == newest_first[200:] and 'rel="next"' not in r3.text
    r4 = c.get("/calls?page=4")
    assert r4.status_code == 200 and listed_calls(r4.text) == [] and "past the end" in r4.text
    # Tape ids link to tapes only when the tape is in the browsed files.
    tid = site["tapes"][0]["id"]
    assert f'href="/tapes/{tid}"' in c.get("/calls?page=1").text + r2.text + r3.text
    assert 'href="/tapes/not-a-tape-' not in r1.text + r2.text + r3.text


def test_calls_of_one_tape_and_one_call(site):
    c = site["client"]
    t = site["tapes"][5]
    r = c.get(f"/calls?tape={t['id']}")
    assert listed_calls(r.text) == [f"call-{t['id']}"]
    r = c.get(f"/calls/call-{t['id']}")
    assert r.status_code == 200
    text = html.unescape(r.text)
    assert "You are a careful math tutor." in text and t["question"] in text
    assert '<div class="role">system</div>' in r.text and '<div class="role">user</div>' in r.text
    assert '"temperature": 1.0' in text and t["steps"][1]["text"] in text
    assert f'href="/tapes/{t["id"]}"' in r.text
    assert f"prompt {len(t['prompt_token_ids'])} · completion {len(t['completion_token_ids'])}" in text


def test_calls_page_query_walks_the_created_index(site):
    store = site["app"].state.browser.calls
    plan = store.query_plan(page=2)
    assert "SCAN llm_calls USING COVERING INDEX idx_llm_calls_created" in plan
    assert "SCAN llm_calls\n" not in plan + "\n"  # never a full table scan


def test_call_log_is_opened_read_only_and_left_unchanged(tmp_path):
    run = tmp_path / "run"
    make_run(run, extra_calls=10)
    db = run / "llm_calls.sqlite"
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    app = create_app(run)
    with TestClient(app, base_url=BASE) as c:
        assert c.get("/calls").status_code == 200
        assert c.get("/calls/extra-000003").status_code == 200
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            app.state.browser.calls.conn.execute("DELETE FROM llm_calls")
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    # Nothing else was written (SQLite's WAL side files aside, which any reader may create).
    assert {p.name for p in run.iterdir()} - {"llm_calls.sqlite-shm", "llm_calls.sqlite-wal"} == {
        "config.yaml", "eval", "iterations", "llm_calls.sqlite", "state.json"}
    wal = run / "llm_calls.sqlite-wal"
    assert not wal.exists() or wal.stat().st_size == 0


def test_call_log_that_cannot_be_opened_for_wal_reading_falls_back_to_immutable(tmp_path, monkeypatch):
    # What SQLite does with a WAL log in a read-only directory without its -shm file.
    import gsm8kctl.browse.calls as calls_mod

    real = calls_mod._open_ro
    seen = []

    def fake(path, immutable=False):
        seen.append(immutable)
        if not immutable:
            raise sqlite3.OperationalError("unable to open database file")
        return real(path, immutable)

    monkeypatch.setattr(calls_mod, "_open_ro", fake)
    run = tmp_path / "run"
    make_run(run, extra_calls=5)
    with TestClient(create_app(run), base_url=BASE) as c:
        assert "calls 1–" in c.get("/calls").text
    assert seen == [False, True]


def test_without_a_call_log_tapes_still_browse(tmp_path):
    run = tmp_path / "run"
    make_run(run, calls=False)
    with TestClient(create_app(run), base_url=BASE) as c:
        r = c.get("/")
        assert r.status_code == 200 and "LLM calls (unavailable)" in r.text
        r = c.get("/calls")
        assert r.status_code == 200 and "LLM calls are unavailable" in r.text
        tid = listed(c.get("/").text)[0]
        assert "LLM calls are unavailable" in c.get(f"/tapes/{tid}").text
        assert c.get("/calls/anything").status_code == 404
        assert "unavailable" in c.get("/summary").text


def test_explicit_llm_calls_option(tmp_path):
    run = tmp_path / "run"
    make_run(run, calls=False)
    other = tmp_path / "elsewhere"
    make_run(other, extra_calls=3)
    with pytest.raises(UserError, match="no such LLM call database"):
        create_app(run, llm_calls=tmp_path / "missing.sqlite")
    with TestClient(create_app(run, llm_calls=other / "llm_calls.sqlite"), base_url=BASE) as c:
        assert "calls 1–" in c.get("/calls").text


def test_a_database_without_the_table_or_garbage_is_reported_not_fatal(tmp_path):
    run = tmp_path / "run"
    make_run(run, calls=False)
    sqlite3.connect(run / "llm_calls.sqlite").execute("CREATE TABLE other (x)").connection.commit()
    with TestClient(create_app(run), base_url=BASE) as c:
        assert "has no &#39;llm_calls&#39; table" in c.get("/calls").text
    (run / "llm_calls.sqlite").write_bytes(b"not a database at all" * 100)
    with TestClient(create_app(run), base_url=BASE) as c:
        r = c.get("/calls")
        assert r.status_code == 200 and "cannot read" in r.text


def test_llm_calls_search_is_bounded(tmp_path):
    # Found two levels above a tapes file, in the run directory.
    run = tmp_path / "runs" / "r"
    make_run(run, extra_calls=0)
    tapes = run / "iterations" / "0000" / "tapes.jsonl"
    assert find_llm_calls(tapes) == (run / "llm_calls.sqlite").resolve()
    assert find_llm_calls(run) == (run / "llm_calls.sqlite").resolve()
    # Never above the run directory (it has config.yaml / state.json).
    (tmp_path / "runs" / "llm_calls.sqlite").write_bytes(b"")
    (run / "llm_calls.sqlite").unlink()
    assert find_llm_calls(tapes) is None
    # At most MAX_PARENTS levels up from a loose file.
    deep = tmp_path / "x" / "a" / "b" / "c" / "d" / "e"
    deep.mkdir(parents=True)
    (tmp_path / "x" / "llm_calls.sqlite").write_bytes(b"")
    loose = deep / "t.jsonl"
    loose.write_text("")
    assert MAX_PARENTS < 5
    assert find_llm_calls(loose) is None
    assert find_llm_calls(tmp_path / "x" / "a" / "t.jsonl") == (tmp_path / "x" / "llm_calls.sqlite").resolve()
    # Ends at the filesystem root.
    assert find_llm_calls(Path("/")) is None or Path("/llm_calls.sqlite").exists()


# ---------------------------------------------------------------------------------------------
# Summary


def test_summary_numbers(site):
    from gsm8kctl.artifacts.tapes import pass_at_k

    r = site["client"].get("/summary")
    assert r.status_code == 200
    s = site["app"].state.browser.index.summary()
    tapes = site["tapes"]
    assert s["total"] == len(tapes)
    for g in s["groups"]:
        mine = [t for t in tapes if (t["iteration"], t["split"]) == (g["iteration"], g["split"])]
        assert g["tapes"] == len(mine)
        assert g["accuracy"] == pytest.approx(sum(t["correct"] for t in mine) / len(mine))
        assert g["overflow_rate"] == pytest.approx(sum(t["finish_reason"] == "length" for t in mine) / len(mine))
        assert g["format_rate"] == pytest.approx(sum(bool(t["answer"]["format"]) for t in mine) / len(mine))
        by_problem: dict = {}
        for t in mine:
            by_problem.setdefault(t["problem_id"], []).append(t["correct"])
        k = min(len(v) for v in by_problem.values())
        assert g["k"] == k
        assert g["pass_at_k"] == pytest.approx(
            sum(pass_at_k(len(v), sum(v), k) for v in by_problem.values()) / len(by_problem))
        assert g["file"] in r.text
    assert "pass@k" in r.text and f"{len(tapes)} tapes in 3 files" in r.text


# ---------------------------------------------------------------------------------------------
# Security: escaping, traversal, Host header, headers


def test_model_text_is_escaped_everywhere(site):
    c, evil = site["client"], site["evil"]
    from urllib.parse import quote

    pages = {
        "list": c.get("/?per_page=500").text,
        "search": c.get("/?q=" + quote("<script>")).text,
        "tape": c.get("/tapes/" + quote(evil["id"], safe="")).text,
        "raw": c.get("/raw/" + quote(evil["id"], safe="")).text,
        "calls": c.get("/calls?page=3").text + c.get("/calls?tape=" + quote(evil["id"])).text,
        "call": c.get("/calls/call-evil").text,
    }
    for name, text in pages.items():
        if name == "raw":
            continue
        assert "<script>alert" not in text, name
        assert "<img src=x" not in text, name
        assert "</pre></td>" not in text, name
    tape = pages["tape"]
    assert "&lt;script&gt;alert(&#34;xss&#34;)&lt;/script&gt;" in tape or "&lt;script&gt;alert(&#34;xss&#34;)" in tape
    assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in tape
    assert "tool_call&lt;script&gt;" in tape  # unknown step kinds shown as escaped JSON
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in pages["list"]  # the id
    assert "user&lt;script&gt;" in pages["call"]
    # The raw JSON view is JSON, not HTML: no sniffing, CSP forbids scripts anyway.
    raw = c.get("/raw/" + quote(evil["id"], safe=""))
    assert raw.headers["content-type"] == "application/json"
    assert raw.headers["x-content-type-options"] == "nosniff"


def test_reflected_params_and_paths_are_escaped(site):
    c = site["client"]
    r = c.get('/?q="><script>alert(1)</script>')
    assert r.status_code == 200 and "<script>alert(1)" not in r.text
    assert 'value="&#34;&gt;&lt;script&gt;alert(1)&lt;/script&gt;"' in r.text
    r = c.get("/?page=<script>alert(1)</script>")
    assert r.status_code == 400 and "<script>alert(1)" not in r.text and "&lt;script&gt;" in r.text
    r = c.get("/tapes/<img src=x onerror=alert(1)>")
    assert r.status_code == 404 and "<img src=x" not in r.text


def test_security_headers(site):
    r = site["client"].get("/")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"


def test_foreign_host_header_is_refused(site):
    r = site["client"].get("/", headers={"host": "evil.example"})
    assert r.status_code == 400
    assert site["client"].get("/", headers={"host": "localhost:7680"}).status_code == 200


@pytest.mark.parametrize("bound", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_host_header_check_on_every_loopback_address(tmp_path, monkeypatch, bound):
    """The check is on for any loopback --host (127.0.0.0/8, ::1), not only 127.0.0.1/localhost."""
    import uvicorn

    from gsm8kctl.stages import browse as stage

    apps = []
    monkeypatch.setattr(stage, "_bind", lambda host, port: __import__("socket").socket())
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: apps.append(self.config.app))
    make_run(tmp_path / "run", iterations=1, eval_problems=0, calls=False)
    stage.browse(str(tmp_path / "run"), host=bound, port=0, quiet=True)
    with TestClient(apps[0], base_url=BASE) as c:
        for evil in ("evil.example.com", "evil.example.com:7680", "127.0.0.1.evil.example", "[::2]:80",
                     "localhost.evil.example", "10.0.0.1"):
            assert c.get("/", headers={"host": evil}).status_code == 400, (bound, evil)
        for good in ("127.0.0.1:7680", "127.0.0.2", "localhost:7680", "[::1]:7680", "LOCALHOST"):
            assert c.get("/", headers={"host": good}).status_code == 200, (bound, good)


def test_host_header_check_is_off_where_the_user_shares(tmp_path, monkeypatch):
    import uvicorn

    from gsm8kctl.stages import browse as stage

    apps = []
    monkeypatch.setattr(stage, "_bind", lambda host, port: __import__("socket").socket())
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: apps.append(self.config.app))
    make_run(tmp_path / "run", iterations=1, eval_problems=0, calls=False)
    stage.browse(str(tmp_path / "run"), host="0.0.0.0", port=0, quiet=True)
    with TestClient(apps[0], base_url=BASE) as c:
        assert c.get("/", headers={"host": "box.example.com:7680"}).status_code == 200


def test_symlinks_out_of_path_are_not_served(tmp_path):
    """A tapes file (or directory) inside PATH that links outside it is neither indexed nor read."""
    import random

    rng = random.Random(0)
    outside = tmp_path / "outside"
    secret = fake_tape(iteration=0, split="train", problem_index=7, attempt=0, outcome="correct", rng=rng)
    secret["id"] = "secret-tape"
    write_jsonl(outside / "tapes.jsonl", [secret])
    run = tmp_path / "run"
    make_run(run, iterations=1, eval_problems=0, calls=False)
    (run / "iterations" / "0001").mkdir()
    (run / "iterations" / "0001" / "tapes.jsonl").symlink_to(outside / "tapes.jsonl")
    (run / "linked").symlink_to(outside, target_is_directory=True)
    # A link that stays inside PATH is fine.
    (run / "iterations" / "0000" / "again.tapes.jsonl").symlink_to(run / "iterations" / "0000" / "tapes.jsonl")
    found = [str(p.relative_to(run)) for p in discover_tape_files(run)]
    assert found == ["iterations/0000/again.tapes.jsonl", "iterations/0000/tapes.jsonl"]
    with TestClient(create_app(run), base_url=BASE) as c:
        ids = all_listed(c)
        assert ids and "secret-tape" not in ids
        assert c.get("/tapes/secret-tape").status_code == 404
        assert c.get("/raw/secret-tape").status_code == 404
        assert "secret-tape" not in c.get("/?q=secret").text
    # A served file swapped for a link out of PATH after indexing is not read any more.
    index = TapeIndex(run)
    row = index.row(all_listed_ids(index)[0])
    real = run / "iterations" / "0000" / "tapes.jsonl"
    real.rename(run / "moved.jsonl")
    real.symlink_to(outside / "tapes.jsonl")
    assert index.load(row) is None
    index.close()


def all_listed_ids(index: TapeIndex) -> list[str]:
    return [r["id"] for r in index.page(Filters(), "file", 0, 500)]


def _raw_get(app, raw_path: str) -> tuple[int, bytes]:
    """Send a path to the ASGI app exactly as given (clients normalize '..')."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    path, _, query = raw_path.partition("?")
    from urllib.parse import unquote

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": unquote(path), "raw_path": path.encode(), "query_string": query.encode(),
             "root_path": "", "headers": [(b"host", b"127.0.0.1")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


@pytest.mark.parametrize("path", [
    "/static/../app.py", "/static/../../browse/app.py", "/static/%2e%2e/app.py", "/static/..%2fapp.py",
    "/static/..%2f..%2f..%2f..%2f..%2fetc%2fpasswd", "/static//etc/passwd", "/tapes/../../../../etc/passwd",
    "/raw/..%2F..%2F..%2Fetc%2Fpasswd", "/raw/../iterations/0000/tapes.jsonl", "/calls/../../llm_calls.sqlite",
    "/../../../../etc/passwd",
])
def test_no_path_traversal(site, path):
    status, body = _raw_get(site["app"], path)
    assert status == 404, (path, status)
    assert b"root:" not in body and b"def create_app" not in body and b"SQLite format" not in body


def test_static_files_are_served(site):
    r = site["client"].get("/static/browse.css")
    assert r.status_code == 200 and "text/css" in r.headers["content-type"]
    assert site["client"].get("/static/browse.js").status_code == 200


# ---------------------------------------------------------------------------------------------
# Index: files that grow or get replaced, bad lines, duplicates, gathered and TapeAgents tapes


def test_index_follows_appends_and_replacements(tmp_path, monkeypatch):
    import random

    import gsm8kctl.browse.index as index_mod

    monkeypatch.setattr(index_mod, "_REFRESH_EVERY_S", 0.0)
    rng = random.Random(0)
    f = tmp_path / "tapes.jsonl"
    first = [fake_tape(iteration=0, split="train", problem_index=i, attempt=0, outcome="correct", rng=rng)
             for i in range(3)]
    write_jsonl(f, first)
    with open(f, "a") as fh:  # a writer in the middle of a line
        fh.write(json.dumps(first[0])[:40])
    with TestClient(create_app(f), base_url=BASE) as c:
        assert all_listed(c) == [t["id"] for t in first]
        more = fake_tape(iteration=0, split="train", problem_index=7, attempt=0, outcome="wrong", rng=rng)
        with open(f, "a") as fh:  # ... finishes it (as garbage) and appends a tape
            fh.write("\n" + json.dumps(more) + "\n")
        assert all_listed(c) == [t["id"] for t in first] + [more["id"]]
        assert "line at byte" in c.get("/summary").text  # the broken line is reported
        # An atomic rewrite (rerun of a stage): old rows go, new rows come, no stale offsets.
        new = [fake_tape(iteration=1, split="train", problem_index=i, attempt=1, outcome="wrong", rng=rng)
               for i in range(2)]
        tmp = tmp_path / ".tapes.tmp"
        write_jsonl(tmp, new)
        tmp.replace(f)
        assert all_listed(c) == [t["id"] for t in new]
        assert c.get(f"/tapes/{first[0]['id']}").status_code == 404
        assert c.get(f"/tapes/{new[1]['id']}").status_code == 200


def test_new_iteration_directories_appear(tmp_path, monkeypatch):
    import gsm8kctl.browse.index as index_mod

    monkeypatch.setattr(index_mod, "_REFRESH_EVERY_S", 0.0)
    monkeypatch.setattr(index_mod, "_DISCOVER_EVERY_S", 0.0)
    run = tmp_path / "run"
    make_run(run, iterations=1, eval_problems=0, calls=False)
    with TestClient(create_app(run), base_url=BASE) as c:
        n = len(all_listed(c))
        make_run(tmp_path / "other", iterations=3, eval_problems=0, calls=False)
        (run / "iterations" / "0002").mkdir()
        (tmp_path / "other" / "iterations" / "0002" / "tapes.jsonl").rename(run / "iterations" / "0002" / "tapes.jsonl")
        assert len(all_listed(c)) == n + 24
        assert "iterations/0002/tapes.jsonl" in c.get("/summary").text


def test_duplicate_ids_and_non_tapes_are_counted(tmp_path):
    import random

    rng = random.Random(0)
    t = fake_tape(iteration=0, split="train", problem_index=0, attempt=0, outcome="correct", rng=rng)
    write_jsonl(tmp_path / "a" / "tapes.jsonl", [t, {"not": "a tape"}, [1, 2]])
    write_jsonl(tmp_path / "b" / "tapes.jsonl", [t])
    index = TapeIndex(tmp_path)
    s = index.summary()
    assert s["total"] == 1
    assert [(f["tapes"], f["duplicates"], f["not_tapes"]) for f in s["files"]] == [(1, 0, 2), (0, 1, 0)]
    index.close()


def test_nan_and_infinity_lines_are_bad_lines_not_tapes(tmp_path):
    """Python's json reads NaN/Infinity; the index refuses them as it refuses invalid JSON."""
    import random

    rng = random.Random(0)
    ok = fake_tape(iteration=0, split="train", problem_index=0, attempt=0, outcome="correct", rng=rng)
    lines = [json.dumps(ok)]
    for i, (key, bad) in enumerate((("reward", "NaN"), ("logprobs", "[-0.5, -Infinity]"), ("reward", "1e999"))):
        t = fake_tape(iteration=0, split="train", problem_index=0, attempt=i + 1, outcome="wrong", rng=rng)
        t["logprobs"] = [-0.5, -0.25]
        t["completion_token_ids"] = t["completion_token_ids"][:2]
        line = json.dumps(t)
        old = f'"{key}": ' + json.dumps(t[key])
        assert old in line
        lines.append(line.replace(old, f'"{key}": {bad}'))
    (tmp_path / "tapes.jsonl").write_text("\n".join(lines) + "\n")
    index = TapeIndex(tmp_path)
    (f,) = index.summary()["files"]
    assert (f["tapes"], f["bad_lines"]) == (1, 3)
    assert "reward is not a finite number" in f["first_bad"]
    assert all_listed_ids(index) == [ok["id"]]
    index.close()


def test_fast_head_parse_agrees_with_full_parse(site):
    from gsm8kctl.browse.index import _row_of

    for p in discover_tape_files(site["run"]):
        for line in p.read_bytes().splitlines(keepends=True):
            full = json.loads(line)
            parsed = _parse_head(line)
            assert parsed is not None
            head, n = parsed
            assert n == len(full["completion_token_ids"])
            assert _row_of(head, n, {}) == _row_of(full, n, {})
    # Another key order: no fast path, same result through the full parse.
    t = dict(reversed(list(site["tapes"][0].items())))
    assert _parse_head(json.dumps(t).encode()) is None


def test_browse_a_gathered_file_with_tapeagents_tapes(tmp_path):
    from gsm8kctl.stages.gather_tapes import gather_tapes

    run = tmp_path / "run"
    make_run(run, iterations=1, calls=False)
    ta = [{"metadata": {"id": "ta-1", "parent_id": "p", "author": "COTMathAgent", "result": {}},
           "context": None,
           "steps": [{"metadata": {"id": "s0", "prompt_id": "", "node": "", "agent": "", "other": {"value": 72}},
                      "kind": "task", "task": "How many clips?"},
                     {"metadata": {"id": "s1", "prompt_id": "pr-1", "node": "cot", "agent": "a", "other": {}},
                      "kind": "reasoning_thought_with_value", "reasoning": "48 + 24 = 72\nThe answer is: 72",
                      "value": 72},
                     {"metadata": {"id": "s2", "prompt_id": "", "node": "", "agent": "", "other": {}},
                      "kind": "use_calculator_action", "expression": "48+24"}]}]
    (tmp_path / "ta" / "tapes" / "train" / "3").mkdir(parents=True)
    (tmp_path / "ta" / "tapes" / "train" / "3" / "tapes.json").write_text(json.dumps(ta))
    out = tmp_path / "all.jsonl"
    gather_tapes([str(run), str(tmp_path / "ta")], str(out), quiet=True)
    with TestClient(create_app(out), base_url=BASE) as c:
        ids = all_listed(c)
        assert len(ids) == 24 + 5 + 1 and "ta-1" in ids
        assert all_listed(c, "iteration=3&outcome=correct") == ["ta-1"]
        r = c.get("/tapes/ta-1")
        assert r.status_code == 200
        assert "The answer is: 72" in r.text and "use_calculator_action" in r.text
        assert "prompt - · completion -" in r.text  # no token ids in TapeAgents tapes
        assert "LLM calls are unavailable" in r.text
        assert c.get("/summary").status_code == 200


def test_missing_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such file or directory"):
        create_app(tmp_path / "nope")


def test_empty_run_directory_browses(tmp_path):
    with TestClient(create_app(tmp_path), base_url=BASE) as c:
        r = c.get("/")
        assert r.status_code == 200 and "no tapes match" in r.text
        assert c.get("/summary").status_code == 200


def test_filters_dataclass_default_is_empty():
    assert Filters().is_empty() and not Filters(outcome="wrong").is_empty()


# ---------------------------------------------------------------------------------------------
# Token pieces for shading


def test_token_spans_reassemble_and_merge_split_characters(site):
    tok = site["tok"]
    text = "Café ≠ 72 😀 \\boxed{72}\n<b>x</b>"
    ids = tok.encode(text).ids
    spans = token_spans(tok, ids)
    assert spans is not None
    assert "".join(s[2] for s in spans) == tok.decode(ids)
    assert spans[0][0] == 0 and spans[-1][1] == len(ids)
    assert all(a < b for a, b, _ in spans)
    assert "\ufffd" not in "".join(s[2] for s in spans)
    # Multi-byte characters the tiny vocabulary has to split into byte tokens were merged.
    assert any(b - a > 1 for a, b, _ in spans)
    pieces = shaded_pieces(tok, ids, [-0.01] * len(ids))
    assert all(p["bucket"] == 0 for p in pieces)
    assert shaded_pieces(tok, [10**9], [-1.0]) is None  # an id outside the vocabulary


def test_bucket_edges():
    import math

    assert bucket(0.0) == 0 and bucket(math.log(0.9)) == 0
    assert bucket(math.log(0.89)) == 1 and bucket(math.log(0.3)) == 2
    assert bucket(math.log(0.1)) == 3 and bucket(-10) == 4
    assert bucket(None) == 0 and bucket(float("nan")) == 0


# ---------------------------------------------------------------------------------------------
# The stage function (no server started)


def test_browse_stage_checks_and_warns(tmp_path, monkeypatch, capsys):
    import uvicorn

    from gsm8kctl.stages import browse as stage

    with pytest.raises(UserError, match="no such file"):
        stage.browse(str(tmp_path / "nope"))
    assert stage.is_loopback("127.0.0.1") and stage.is_loopback("localhost") and stage.is_loopback("::1")
    assert not stage.is_loopback("0.0.0.0") and not stage.is_loopback("192.168.1.5")

    started = {}

    def fake_run(self, sockets=None):
        started["port"] = sockets[0].getsockname()[1]
        started["hosts"] = self.config.app

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    run = tmp_path / "run"
    make_run(run, iterations=1, calls=False)
    stage.browse(str(run), host="127.0.0.1", port=0)
    err = capsys.readouterr().err
    assert "warning" not in err and f"browse at http://127.0.0.1:{started['port']}/" in err
    assert "29 tapes in 2 file(s)" in err and "LLM calls unavailable" in err
    stage.browse(str(run), host="0.0.0.0", port=0)
    assert "warning: serving on 0.0.0.0" in capsys.readouterr().err
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(UserError, match="cannot listen"):
            stage.browse(str(run), port=busy.getsockname()[1])
    with pytest.raises(UserError, match="--port"):
        stage.browse(str(run), port=70000)


def test_discovery_takes_tapes_files_only_and_skips_hidden(tmp_path):
    for rel in ("iterations/0001/tapes.jsonl", "iterations/0000/tapes.jsonl", "eval/0000/tapes.jsonl",
                "gathered/old.tapes.jsonl", "iterations/0000/samples.jsonl", "metrics.jsonl",
                ".git/tapes.jsonl", "iterations/0000/.tapes.jsonl.abc.tmp"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    got = [str(p.relative_to(tmp_path)) for p in discover_tape_files(tmp_path)]
    assert got == ["gathered/old.tapes.jsonl", "iterations/0000/tapes.jsonl", "eval/0000/tapes.jsonl",
                   "iterations/0001/tapes.jsonl"]


def test_browse_stage_warns_about_a_file_without_jsonl_tapes(tmp_path, monkeypatch, capsys):
    import uvicorn

    from gsm8kctl.stages import browse as stage

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    f = tmp_path / "tapes.json"
    f.write_text(json.dumps([{"metadata": {"id": "x"}, "steps": []}], indent=2))
    stage.browse(str(f), port=0)
    assert "convert other layouts (TapeAgents JSON) with gather-tapes" in capsys.readouterr().err


def test_forced_tokenizer_option(tmp_path, site):
    run = tmp_path / "run"
    make_run(run, iterations=1, eval_problems=0, calls=False, tokenizer=site["tok"], model="unknown-model")
    with pytest.raises(UserError, match="no such tokenizer"):
        create_app(run, tokenizer=tmp_path / "nope")
    tid = json.loads((run / "iterations" / "0000" / "tapes.jsonl").read_text().splitlines()[0])["id"]
    with TestClient(create_app(run), base_url=BASE) as c:
        assert 'class="tok b' not in c.get(f"/tapes/{tid}").text
    with TestClient(create_app(run, tokenizer=site["ckpt"] / "tokenizer.json"), base_url=BASE) as c:
        assert 'class="tok b' in c.get(f"/tapes/{tid}").text
