"""`browse`: serve the tape browser (gsm8kctl.browse) on a local port until interrupted."""

from __future__ import annotations

import socket
import threading
import time
import webbrowser
from pathlib import Path

from rich.markup import escape

from gsm8kctl.browse.app import is_loopback  # noqa: F401 (re-export: the stage decides with it)
from gsm8kctl.errors import UserError
from gsm8kctl.progress import console, warn

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7680


def _bind(host: str, port: int) -> socket.socket:
    """Bind before starting uvicorn: a clean error for a busy port, and port 0 = any free port."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"--host {host}: cannot resolve ({exc.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}; "
                        "try another --port (0 = any free port)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def browse(path: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, llm_calls: str | None = None,
           open_browser: bool = False, *, tokenizer: str | None = None, quiet: bool = False) -> None:
    """Index PATH (a tapes file, a gathered file or a run directory) and serve it until Ctrl-C."""
    import uvicorn

    from gsm8kctl.browse.app import LOOPBACK_HOSTS, create_app

    if not Path(path).exists():
        raise UserError(f"{path}: no such file or directory")
    if not (0 <= port <= 65535):
        raise UserError(f"--port {port}: expected 0..65535")
    # Host and port first: a busy port or a bad host is refused before minutes of indexing.
    sock = _bind(host, port)
    loopback = is_loopback(host)
    if not loopback:
        warn(f"serving on {host}: anyone who can reach this machine can read these tapes and LLM calls "
             "(no authentication). Use --host 127.0.0.1 to keep it local.")
    start = time.perf_counter()
    if not quiet:
        console.print(f"indexing {escape(str(path))} ...", highlight=False)
    # Host-header check against DNS rebinding on loopback (any loopback address: 127.0.0.2 too);
    # on other hosts the user chose to share.
    allowed = [*LOOPBACK_HOSTS, host] if loopback else None
    try:
        app = create_app(path, llm_calls, tokenizer=tokenizer, allowed_hosts=allowed)
    except BaseException:
        sock.close()
        raise
    state = app.state.browser
    real_port = sock.getsockname()[1]
    shown_host = f"[{host.strip('[]')}]" if ":" in host else host
    url = f"http://{shown_host}:{real_port}/"
    if not quiet:
        calls = (f"LLM calls: {state.calls.path}" if state.calls.available
                 else f"LLM calls unavailable: {state.calls.error}")
        console.print(f"{state.index.total()} tapes in {len(state.index.files)} file(s), indexed in "
                      f"{time.perf_counter() - start:.1f}s; {escape(calls)}", highlight=False, soft_wrap=True)
        if state.index.total() == 0 and Path(path).is_file() and Path(path).stat().st_size > 0:
            warn(f"no tapes read from {path}: the browser reads JSONL tapes; convert other layouts "
                 "(TapeAgents JSON) with gather-tapes first")
        console.print(f"browse at {url}  (Ctrl-C to stop)", highlight=False, soft_wrap=True)
    if open_browser:
        threading.Timer(0.5, webbrowser.open, args=(url,)).start()
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
