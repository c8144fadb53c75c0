"""The tape browser: a small server-rendered Starlette app over tapes files and the LLM call log.

Routes (all GET):
  /                    tape list: filters, sort, server-side paging
  /tapes/{id}          one tape: question, gold, completion with logprob shading, answers vs gold,
                       siblings (same problem, iteration, split), previous/next in the list, calls
  /raw/{id}            the tape's JSON line as stored
  /calls               the whole call log, newest first, 100 per page (?tape=ID narrows it)
  /calls/{id}          one call: messages, parameters, completion, latency, token counts
  /summary             per file / iteration / split: counts, accuracy, pass@k, format, overflow
  /static/...          CSS and a few lines of JS shipped with the package

Safety: Jinja2 autoescape is on for every template and the Content-Security-Policy allows no
inline script, so model text cannot run; only the tapes files found under PATH are ever read (by
byte offset from the index, never by a path taken from the URL; real paths, so a symlink out of
PATH is not followed); SQL is parameterized; on a loopback address the Host header is checked so
a DNS-rebinding page cannot read a local server.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import json
import math
import sys
import traceback
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import quote, urlencode

import jinja2
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders, QueryParams
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from gsm8kctl.browse.calls import CALLS_PER_PAGE, CallStore
from gsm8kctl.browse.index import (MAX_QUERY_CHARS, OUTCOMES, SORT_LABELS, SORTS, Filters, TapeIndex,
                                   completion_text)
from gsm8kctl.browse.tokens import TokenizerFinder, logprob_strip, logprob_summary, shaded_pieces
from gsm8kctl.errors import UserError

HERE = Path(__file__).parent
DEFAULT_PER_PAGE = 50
MAX_PER_PAGE = 500
# Query integers go to SQLite, whose integers are 64-bit: a larger one is an OverflowError (a 500).
# A page is also multiplied into an OFFSET; no list has a billion pages.
MAX_INT = 2**63 - 1
MAX_PAGE = 10**9
MAX_PARAM_CHARS = 300
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_MAIN_STEP_KINDS = ("question", "reasoning", "answer")

CSP = ("default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self' data:; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


def create_app(path: str | Path, llm_calls: str | Path | None = None, *, tokenizer: str | Path | None = None,
               allowed_hosts: list[str] | tuple[str, ...] | None = LOOPBACK_HOSTS) -> Starlette:
    """The browser app over PATH (a tapes file, a gathered file, or a run directory).

    `llm_calls` names the call log; by default the nearest `llm_calls.sqlite` up to the run
    directory is used. `tokenizer` forces the tokenizer used for logprob shading.
    `allowed_hosts` are the Host header values served (None or ["*"]: any); when one of them is a
    loopback name, every loopback name is (`is_loopback`).
    """
    root = Path(path)
    if not root.exists():
        raise UserError(f"{root}: no such file or directory")
    if tokenizer is not None and not Path(tokenizer).exists():
        raise UserError(f"{tokenizer}: no such tokenizer directory or tokenizer.json (--tokenizer)")
    calls = CallStore.open(root, llm_calls)  # first: a wrong --llm-calls fails before indexing
    index = TapeIndex(root)
    base = index.root if index.root.is_dir() else index.root.parent
    finder = TokenizerFinder([base], tokenizer)
    templates = Jinja2Templates(env=_jinja_env())
    state = _State(index=index, calls=calls, finder=finder, templates=templates)

    @asynccontextmanager
    async def lifespan(app):
        yield
        index.close()
        calls.close()

    routes = [
        Route("/", state.tape_list, name="tapes"),
        Route("/summary", state.summary, name="summary"),
        Route("/calls", state.call_list, name="calls"),
        Route("/calls/{call_id:path}", state.call_view, name="call"),
        Route("/raw/{tape_id:path}", state.tape_raw, name="raw"),
        Route("/tapes/{tape_id:path}", state.tape_view, name="tape"),
        Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
    ]
    middleware = [Middleware(_SecurityHeaders)]
    if allowed_hosts and "*" not in allowed_hosts:
        middleware.append(Middleware(_HostCheck, allowed=allowed_hosts))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: state.http_error, Exception: state.internal_error},
        lifespan=lifespan,
    )
    app.state.browser = state
    return app


# ---------------------------------------------------------------------------------------------
# Templates and small helpers


def _jinja_env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,  # every template, whatever its name: model text is untrusted
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = lambda s: quote(str(s), safe="")
    env.filters["num"] = _num
    env.filters["pct"] = lambda x: "-" if x is None else f"{100 * x:.1f}%"
    env.filters["ts"] = _ts
    return env


def _num(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if x.is_integer() and abs(x) < 1e15:
            return f"{int(x)}"
        return f"{x:.{digits}g}" if abs(x) < 1e-3 or abs(x) >= 1e6 else f"{round(x, digits):g}"
    return str(x)


def _ts(x) -> str:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return "-"
    try:
        return _dt.datetime.fromtimestamp(x).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return str(x)


def _bad(name: str, raw: str, why: str) -> HTTPException:
    shown = raw if len(raw) <= 60 else raw[:57] + "..."
    return HTTPException(400, f"query parameter '{name}': {why} (got {shown!r})")


def _get(qp: QueryParams, name: str) -> str | None:
    raw = qp.get(name)
    if raw is None or raw.strip() == "":
        return None
    if len(raw) > MAX_PARAM_CHARS:
        raise _bad(name, raw, f"longer than {MAX_PARAM_CHARS} characters")
    return raw.strip()


def _int(qp: QueryParams, name: str, lo: int = -MAX_INT, hi: int = MAX_INT) -> int | None:
    raw = _get(qp, name)
    if raw is None:
        return None
    try:
        v = int(raw)
    except ValueError:
        raise _bad(name, raw, "expected an integer") from None
    if not lo <= v <= hi:
        raise _bad(name, raw, f"out of range {lo}..{hi}")
    return v


def _float(qp: QueryParams, name: str) -> float | None:
    raw = _get(qp, name)
    if raw is None:
        return None
    try:
        v = float(raw)
    except ValueError:
        raise _bad(name, raw, "expected a number") from None
    if not math.isfinite(v):
        raise _bad(name, raw, "expected a finite number")
    return v


def _choice(qp: QueryParams, name: str, choices) -> str | None:
    raw = _get(qp, name)
    if raw is not None and raw not in choices:
        raise _bad(name, raw, f"expected one of {', '.join(choices)}")
    return raw


def _text(qp: QueryParams, name: str, limit: int = MAX_PARAM_CHARS) -> str | None:
    raw = _get(qp, name)
    if raw is not None and len(raw) > limit:
        raise _bad(name, raw, f"longer than {limit} characters")
    return raw


class _ListContext:
    """The tape list's filters, sort and paging, parsed from and written back to a query string."""

    def __init__(self, request: Request, n_files: int):
        qp = request.query_params
        self.filters = Filters(
            iteration=_int(qp, "iteration", lo=0),
            split=_text(qp, "split"),
            outcome=_choice(qp, "outcome", OUTCOMES),
            reward=_float(qp, "reward"),
            problem=_text(qp, "problem"),
            q=_text(qp, "q", MAX_QUERY_CHARS),
            file=_int(qp, "file", lo=0, hi=max(0, n_files - 1)),
        )
        self.sort = _choice(qp, "sort", SORTS) or "file"
        self.page = _int(qp, "page", lo=1, hi=MAX_PAGE) or 1
        self.per_page = _int(qp, "per_page", lo=1, hi=MAX_PER_PAGE) or DEFAULT_PER_PAGE

    def params(self, **extra) -> dict:
        f = self.filters
        out = {"iteration": f.iteration, "split": f.split, "outcome": f.outcome,
               "reward": None if f.reward is None else _num(f.reward), "problem": f.problem, "q": f.q,
               "file": f.file, "sort": None if self.sort == "file" else self.sort,
               "per_page": None if self.per_page == DEFAULT_PER_PAGE else self.per_page}
        out.update(extra)
        return {k: v for k, v in out.items() if v is not None}

    def qs(self, **extra) -> str:
        """Query string of the list context (no page), for links that keep it."""
        return urlencode(self.params(**extra))


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1; IPv6 in brackets or not)."""
    name = host.strip().lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The name of a Host header without its port: `[::1]:7680` -> `::1`, `a.b:80` -> `a.b`."""
    h = header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end > 0 else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class _HostCheck:
    """Answers 400 to a Host header not allowed: a DNS-rebinding page names its own domain.

    A server on loopback answers to every loopback name (127.0.0.2 is as local as 127.0.0.1, and
    starlette's TrustedHostMiddleware cannot parse `[::1]:port`); a rebinding domain is not one.
    """

    def __init__(self, app, allowed):
        self.app = app
        self.allowed = {_host_name(h) for h in allowed}
        self.loopback = any(is_loopback(h) for h in self.allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), "")
        name = _host_name(header)
        if name and (name in self.allowed or (self.loopback and is_loopback(name))):
            await self.app(scope, receive, send)
            return
        await PlainTextResponse("Invalid host header", status_code=400)(scope, receive, send)


class _SecurityHeaders:
    """Adds CSP and friends to every response (a pure ASGI middleware: no body buffering)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["Content-Security-Policy"] = CSP
                headers["X-Content-Type-Options"] = "nosniff"
                headers["X-Frame-Options"] = "DENY"
                headers["Referrer-Policy"] = "no-referrer"
            await send(message)

        await self.app(scope, receive, send_with_headers)


# ---------------------------------------------------------------------------------------------
# Endpoints (plain functions: Starlette runs them in its thread pool; the stores lock)


class _State:
    def __init__(self, *, index: TapeIndex, calls: CallStore, finder: TokenizerFinder,
                 templates: Jinja2Templates):
        self.index = index
        self.calls = calls
        self.finder = finder
        self.templates = templates

    def render(self, request: Request, name: str, status: int = 200, **context) -> Response:
        context.update(
            root=str(self.index.root),
            n_tapes=self.index.total(),
            calls_available=self.calls.available,
            calls_error=self.calls.error,
            calls_path=str(self.calls.path) if self.calls.path else None,
            nav=name,
        )
        return self.templates.TemplateResponse(request, name, context, status_code=status)

    # -- tapes -----------------------------------------------------------------------------

    def tape_list(self, request: Request) -> Response:
        self.index.refresh()
        ctx = _ListContext(request, len(self.index.files))
        total = self.index.count(ctx.filters)
        pages = max(1, math.ceil(total / ctx.per_page))
        rows = self.index.page(ctx.filters, ctx.sort, (ctx.page - 1) * ctx.per_page, ctx.per_page)

        def page_url(p: int) -> str:
            return "/?" + ctx.qs(page=p if p > 1 else None)

        return self.render(
            request, "list.html", ctx=ctx, rows=rows, total=total, pages=pages,
            first_url=page_url(1) if ctx.page > 1 else None,
            prev_url=page_url(min(ctx.page - 1, pages)) if ctx.page > 1 else None,
            next_url=page_url(ctx.page + 1) if ctx.page < pages else None,
            last_url=page_url(pages) if ctx.page < pages else None,
            list_qs=ctx.qs(), facets=self.index.facets(), files=[f.rel for f in self.index.files],
            outcomes=OUTCOMES, sorts=[(s, SORT_LABELS[s]) for s in SORTS], max_query=MAX_QUERY_CHARS,
            start=(ctx.page - 1) * ctx.per_page,
        )

    def _row_and_tape(self, tape_id: str) -> tuple[dict, dict]:
        self.index.refresh()
        row = self.index.row(tape_id)
        tape = self.index.load(row) if row else None
        if row is not None and tape is None:
            # The file changed since it was indexed (rewritten by a rerun): reindex, try again.
            self.index.refresh(force=True)
            row = self.index.row(tape_id)
            tape = self.index.load(row) if row else None
        if row is None or tape is None:
            raise HTTPException(404, f"no tape with id {tape_id!r}")
        return row, tape

    def tape_view(self, request: Request) -> Response:
        tape_id = request.path_params["tape_id"]
        ctx = _ListContext(request, len(self.index.files))
        row, tape = self._row_and_tape(tape_id)
        prev_row, next_row, position = self.index.neighbours(row, ctx.filters, ctx.sort)
        in_list = self.index.matches(row, ctx.filters)
        steps = [s for s in tape.get("steps") or [] if isinstance(s, dict)]
        other_steps = [json.dumps(s, indent=2, ensure_ascii=False) for s in steps
                       if s.get("kind") not in _MAIN_STEP_KINDS]
        ids = tape.get("completion_token_ids")
        logprobs = tape.get("logprobs")
        pieces = None
        tokenizer_found = False
        if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
            tok = self.finder.get(tape.get("model"))
            tokenizer_found = tok is not None
            if tok is not None:
                pieces = shaded_pieces(tok, ids, logprobs)
        answer = tape.get("answer") if isinstance(tape.get("answer"), dict) else {}
        step_call_ids = [str(s["llm_call_id"]) for s in steps if s.get("llm_call_id")]
        calls = self.calls.for_tape(tape_id) if self.calls.available else []
        known_calls = {c["id"] for c in calls}
        missing_calls = [c for c in step_call_ids if c not in known_calls]
        prompt_ids = tape.get("prompt_token_ids")
        return self.render(
            request, "tape.html", tape=tape, row=row, file=self.index.files[row["file"]].rel,
            question=tape.get("question") if isinstance(tape.get("question"), str) else "",
            completion=completion_text(tape), pieces=pieces, tokenizer_found=tokenizer_found,
            strip=logprob_strip(logprobs, ids) if pieces is None else [],
            lp=logprob_summary(logprobs), answer=answer, other_steps=other_steps,
            n_prompt=len(prompt_ids) if isinstance(prompt_ids, list) else None,
            n_completion=len(ids) if isinstance(ids, list) else None,
            siblings=self.index.siblings(row), prev_row=prev_row, next_row=next_row,
            position=position if in_list else None, in_list=in_list,
            list_total=self.index.count(ctx.filters), list_qs=ctx.qs(), ctx=ctx,
            back_url="/?" + ctx.qs(page=math.ceil(position / ctx.per_page)
                                   if in_list and position > ctx.per_page else None),
            calls=calls, missing_calls=missing_calls,
        )

    def tape_raw(self, request: Request) -> Response:
        _, tape = self._row_and_tape(request.path_params["tape_id"])
        return JSONResponse(tape)

    # -- calls -----------------------------------------------------------------------------

    def call_list(self, request: Request) -> Response:
        qp = request.query_params
        page = _int(qp, "page", lo=1, hi=MAX_PAGE) or 1
        tape_id = _text(qp, "tape")
        if not self.calls.available:
            return self.render(request, "calls.html", rows=[], total=0, page=1, pages=1, tape=tape_id,
                               first_url=None, prev_url=None, next_url=None, last_url=None, start=0,
                               known_tapes=set(), per_page=CALLS_PER_PAGE)
        total = self.calls.count(tape_id)
        pages = max(1, math.ceil(total / CALLS_PER_PAGE))
        rows = self.calls.page(page, tape_id)

        def page_url(p: int) -> str:
            return "/calls?" + urlencode({k: v for k, v in (("tape", tape_id), ("page", p if p > 1 else None))
                                          if v is not None})

        return self.render(
            request, "calls.html", rows=rows, total=total, page=page, pages=pages, tape=tape_id,
            first_url=page_url(1) if page > 1 else None,
            prev_url=page_url(min(page - 1, pages)) if page > 1 else None,
            next_url=page_url(page + 1) if page < pages else None,
            last_url=page_url(pages) if page < pages else None,
            start=(page - 1) * CALLS_PER_PAGE, per_page=CALLS_PER_PAGE,
            known_tapes=self.index.has(sorted({r["tape_id"] for r in rows if r.get("tape_id")})),
        )

    def call_view(self, request: Request) -> Response:
        call_id = request.path_params["call_id"]
        if not self.calls.available:
            raise HTTPException(404, f"LLM calls are unavailable: {self.calls.error}")
        call = self.calls.get(call_id)
        if call is None:
            raise HTTPException(404, f"no LLM call with id {call_id!r}")
        tape_known = bool(call.get("tape_id")) and bool(self.index.has([str(call["tape_id"])]))
        return self.render(request, "call.html", call=call, tape_known=tape_known)

    # -- summary ---------------------------------------------------------------------------

    def summary(self, request: Request) -> Response:
        self.index.refresh()
        return self.render(request, "summary.html", s=self.index.summary(),
                           n_calls=self.calls.count() if self.calls.available else None,
                           build_seconds=self.index.build_seconds)

    # -- errors ----------------------------------------------------------------------------

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.status_code)
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"nothing at {request.url.path}"
        return self.render(request, "error.html", status=exc.status_code, code=exc.status_code, detail=detail)

    async def internal_error(self, request: Request, exc: Exception) -> Response:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        return self.render(request, "error.html", status=500, code=500,
                           detail=f"internal error: {type(exc).__name__} (details on the server's stderr)")
