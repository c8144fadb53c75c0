"""The OpenAI-compatible backend and the server lifecycle.

Fast tests (no marker) use a dummy HTTP server and a fake OpenAI endpoint: process-group stop,
parent death, start-up deadline, retries. The `vllm` tests run two real vLLM servers on
127.0.0.1 (started once for the module, in parallel): token-exact sampling, scoring, prompts
spread over both, and a server killed mid-run.
"""

from __future__ import annotations

import http.server
import json
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gsm8kctl import agent
from gsm8kctl.artifacts.chat import render_prompt
from gsm8kctl.config import default_config
from gsm8kctl.errors import UserError
from gsm8kctl.loop.serve import ServerProcess, VLLMServer
from gsm8kctl.procs import free_port, group_alive
from gsm8kctl.sampling.backends import SamplingParams, get_backend
from gsm8kctl.sampling.backends.openai import OpenAIBackend, parse_base_urls

REPO = Path(__file__).resolve().parents[1]

DUMMY_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys
    port, healthy = int(sys.argv[1]), sys.argv[2] == "1"
    subprocess.Popen(["sleep", "300"])  # a grandchild, like vLLM's engine process
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if healthy and self.path == "/health" else 503)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _wait_gone(pgid: int, timeout: float = 20) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def dummy(tmp_path):
    path = tmp_path / "dummy_server.py"
    path.write_text(DUMMY_SERVER)
    return path


# ------------------------------------------------------------------------------------ fast
def test_parse_base_urls():
    assert parse_base_urls("http://a:1, http://b:2/v1/") == ["http://a:1/v1", "http://b:2/v1"]
    with pytest.raises(UserError):
        parse_base_urls("a:1")


def test_server_down_at_start_is_a_clear_error():
    port = free_port()
    t0 = time.time()
    with pytest.raises(UserError, match=f"cannot reach http://127.0.0.1:{port}/v1.*is the server running"):
        OpenAIBackend("smollm2-135m", base_url=f"http://127.0.0.1:{port}")
    assert time.time() - t0 < 15


def test_lifecycle_stops_the_whole_group(dummy, tmp_path):
    port = free_port()
    srv = ServerProcess([sys.executable, str(dummy), str(port), "1"], port=port, grace_s=2,
                        log_path=tmp_path / "server.log", startup_timeout_s=30)
    with srv:
        pgid = srv.pgid
        assert group_alive(pgid) and not _port_free(port)
    assert _wait_gone(pgid, 1) and _port_free(port)
    assert "dummy_server.py" in (tmp_path / "server.log").read_text()


def test_startup_deadline(dummy):
    port = free_port()
    srv = ServerProcess([sys.executable, str(dummy), str(port), "0"], port=port, grace_s=1, startup_timeout_s=2)
    with pytest.raises(UserError, match="not healthy after 2 s"):
        with srv:
            pass
    assert _wait_gone(srv.pgid, 1)


def test_server_dies_with_its_parent(dummy):
    """SIGKILL the process that started the server: the supervisor takes the group down."""
    script = textwrap.dedent(f"""
        import sys, time
        from gsm8kctl.procs import free_port
        from gsm8kctl.loop.serve import ServerProcess
        port = free_port()
        srv = ServerProcess([sys.executable, {str(dummy)!r}, str(port), "1"], port=port, grace_s=1)
        srv.start().wait_ready()
        print(srv.pgid, port, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        pgid, port = map(int, parent.stdout.readline().split())
        assert group_alive(pgid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert _wait_gone(pgid, 15), "server group outlived its parent"
    assert _port_free(port)


class _FakeOpenAI(http.server.BaseHTTPRequestHandler):
    root = ""
    script: list[int] = []  # status codes to answer, then 200
    posts = 0

    def do_GET(self):
        self._send(200, {"data": [{"id": "fake", "root": self.root}]})

    def do_POST(self):
        cls = type(self)
        cls.posts += 1
        json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status = cls.script.pop(0) if cls.script else 200
        body = {"choices": [{"index": 0, "text": "", "finish_reason": "stop", "token_ids": [5, 2],
                             "logprobs": {"tokens": ["token_id:5", "token_id:2"],
                                          "token_logprobs": [-0.5, -0.25]}}]}
        self._send(status, body if status == 200 else {"error": "nope"})

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def fake_openai(smollm2_dir):
    _FakeOpenAI.root, _FakeOpenAI.posts, _FakeOpenAI.script = smollm2_dir, 0, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_retries_5xx_but_not_4xx(fake_openai):
    b = OpenAIBackend(None, base_url=fake_openai, retries=3, backoff_s=0.01)
    assert b.model == "fake"
    _FakeOpenAI.script = [503, 502]
    out = b.generate([[1, 2, 3]], SamplingParams(n=1, max_tokens=4))
    assert _FakeOpenAI.posts == 3
    assert out[0][0].token_ids == [5, 2] and out[0][0].logprobs == [-0.5, -0.25] and out[0][0].finish_reason == "stop"
    _FakeOpenAI.script = [400]
    with pytest.raises(UserError, match="HTTP 400"):
        b.generate([[1, 2, 3]], SamplingParams(n=1, max_tokens=4))
    assert _FakeOpenAI.posts == 4  # a bad request is not retried
    _FakeOpenAI.script = [500] * 10
    with pytest.raises(UserError, match="failed after 4 attempts"):
        b.generate([[1, 2, 3]], SamplingParams(n=1, max_tokens=4))
    b.close()


# ------------------------------------------------------------------------------------ real vLLM
@pytest.fixture(scope="module")
def servers(smollm2_dir, tmp_path_factory):
    import vllm  # noqa: F401 - make install puts it there; missing must fail, not skip
    logs = tmp_path_factory.mktemp("vllm-logs")
    pair = [VLLMServer(smollm2_dir, log_path=logs / f"server{i}.log", cfg=default_config()) for i in range(2)]
    try:
        for s in pair:  # both start at once; started from this (main) thread, see serve.py
            s.start()
        for s in pair:
            s.wait_ready()
        yield pair
    finally:
        for s in pair:
            s.stop()
    for s in pair:
        assert not group_alive(s.pgid) and _port_free(s.port)


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from gsm8kctl.artifacts.models import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    qs = ["What is 12 plus 30?", "Sam has 4 boxes of 6 pens. How many pens does he have?"]
    return [render_prompt(tok, agent.build_messages(q))[1] for q in qs]


def _posts(server: VLLMServer) -> int:
    return server.log_path.read_text(errors="replace").count('"POST /v1/completions')


@pytest.mark.vllm
def test_generate_token_exact(servers, prompts, smollm2_dir):
    cfg = default_config()
    cfg["openai"]["base_url"] = servers[0].base_url
    b = get_backend("openai", "smollm2-135m", cfg=cfg)
    assert b.model == smollm2_dir  # the served name: what the tapes record
    out = b.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=5))
    assert [len(c) for c in out] == [2, 2]
    for comps in out:
        for c in comps:
            assert len(c.token_ids) == len(c.logprobs) and c.finish_reason in ("stop", "length")
            assert c.text == b.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert comps[0].token_ids != comps[1].token_ids
    greedy = b.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_tokens=300))[0][0]
    assert greedy.finish_reason == "stop" and greedy.token_ids[-1] in b.stop_ids
    assert "<|im_end|>" not in greedy.text
    # Same seed, one request alone in the engine: same tokens. Concurrent requests are batched as
    # they arrive, so a seeded batch is not bit-identical across calls (docs/architecture.md,
    # "Reproducibility").
    alone = SamplingParams(n=1, temperature=1.0, max_tokens=40, seed=5)
    first = b.generate(prompts[:1], alone)[0][0]
    assert b.generate(prompts[:1], alone)[0][0].token_ids == first.token_ids

    # score(): prompt_logprobs, and the echo fallback, agree with the sampler's log-probs.
    ps = [p for p, comps in zip(prompts, out) for _ in comps]
    cs = [c.token_ids for comps in out for c in comps]
    scored = b.score(ps, cs)
    d = [abs(x - y) for s, comps in zip(scored, [c for comps in out for c in comps])
         for x, y in zip(s, comps.logprobs)]
    assert len(d) == sum(len(c) for c in cs) and max(d) < 0.5 and sum(d) / len(d) < 0.05
    b._score_mode = "echo"
    echo = b.score(ps[:1], cs[:1])[0]
    assert max(abs(x - y) for x, y in zip(echo, scored[0])) < 0.2  # bf16: batch shape matters
    b.close()


@pytest.mark.vllm
def test_prompts_spread_over_servers(servers, prompts):
    before = [_posts(s) for s in servers]
    b = OpenAIBackend(None, base_url=",".join(s.base_url for s in servers))
    out = b.generate(prompts * 4, SamplingParams(n=1, temperature=1.0, max_tokens=8, seed=0))
    assert len(out) == 8
    assert list(b.requests_per_url.values()) == [4, 4]
    time.sleep(0.5)  # access log lines are written after the response
    assert [_posts(s) - n for s, n in zip(servers, before)] == [4, 4]
    b.close()


@pytest.mark.vllm
def test_server_killed_mid_run(servers, smollm2_dir, tmp_path):
    """Retries, then a clear error; the stage writes no tapes from the failed call."""
    from gsm8kctl.stages.sample import sample

    victim = servers[1]
    cfg = default_config()
    cfg.update(model=smollm2_dir, backend="openai", attempts=2)
    cfg["sampling"]["max_tokens"] = 256
    b = OpenAIBackend(smollm2_dir, cfg=cfg, base_url=victim.base_url, retries=3, backoff_s=0.2)
    out = tmp_path / "tapes.jsonl"
    result: dict = {}

    def run():
        try:
            result["stats"] = sample(cfg, out=str(out), split="test", n_problems=8, backend=b, quiet=True)
        except BaseException as e:  # noqa: BLE001 - inspected below
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    time.sleep(3)  # requests are in flight: 8 prompts x 2 x 256 tokens take well over 3 s here
    pgid = victim.pgid
    victim.kill_server()
    t.join(120)
    assert not t.is_alive()
    err = result.get("error")
    assert isinstance(err, UserError), result
    assert "failed after 4 attempts" in str(err) and victim.base_url in str(err)
    assert not out.exists() or out.read_text() == ""
    assert _wait_gone(pgid, 10) and _port_free(victim.port)
    b.close()
