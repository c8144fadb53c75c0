"""The OpenAI-compatible backend: `/v1/completions` on one or many servers (`vllm serve`, SGLang, ...).

Token-exact both ways: the prompt is sent as token ids, and the completion comes back as token
ids (`return_token_ids`, and `return_tokens_as_token_ids` so each log-prob entry names its token
as "token_id:N"), never re-tokenised from text. Prompts are spread round-robin over all base URLs
(many servers = sampling past one machine), each URL with `concurrency` requests in flight. A
failed request (connection error, timeout, 5xx, 429) is retried with exponential backoff on the
next URL; when the retries run out the whole call raises a UserError and returns nothing, so a
stage never writes half a batch.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from gsm8kctl.artifacts.models import load_tokenizer, stop_token_ids
from gsm8kctl.config import setting
from gsm8kctl.errors import UserError
from gsm8kctl.sampling.backends.base import Completion, SamplingParams
from gsm8kctl.sampling.backends.vllm import PASSTHROUGH_EXTRA, seed_of_request

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class _Retryable(Exception):
    pass


def parse_base_urls(value: str | Sequence[str] | None) -> list[str]:
    """"URL[,URL...]" or a list -> normalised bases ending in /v1."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else [u for v in value for u in str(v).split(",")]
    urls = []
    for raw in items:
        u = raw.strip().rstrip("/")
        if not u:
            continue
        if not u.startswith(("http://", "https://")):
            raise UserError(f"base URL '{raw}' must start with http:// or https://")
        if not u.endswith("/v1"):
            u += "/v1"
        urls.append(u)
    return urls


def _is_loopback(url: str) -> bool:
    return (urlsplit(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise UserError(f"server returned token '{token}' instead of 'token_id:N'; it must support "
                        "return_tokens_as_token_ids (vLLM does)")
    return int(token[len("token_id:"):])


class OpenAIBackend:
    name = "openai"

    def __init__(self, model: str | None, cfg: dict | None = None, *, base_url: str | Sequence[str] | None = None,
                 api_key: str | None = None, concurrency: int | None = None, timeout_s: float | None = None,
                 retries: int | None = None, backoff_s: float | None = None, tokenizer: Any = None,
                 connect_timeout_s: float = 10.0):
        """`model`: the served model name or path (also where the tokenizer is read from; an
        embedded name like smollm2-135m is resolved); None = the one model the servers serve.
        `base_url` (or `cfg["openai"]["base_url"]`): one URL, a comma-separated list, or a list."""
        import httpx

        cfg = cfg or {}
        if base_url is None and model and str(model).startswith(("http://", "https://")):
            base_url, model = model, None  # get_backend("openai", "http://...") works too
        self.urls = parse_base_urls(base_url if base_url is not None else setting(cfg, "openai.base_url"))
        if not self.urls:
            raise UserError("backend 'openai' needs --base-url URL[,URL...] (or openai.base_url in the config)")
        self.concurrency = int(concurrency or setting(cfg, "openai.concurrency"))
        self.timeout_s = float(timeout_s or setting(cfg, "openai.timeout_s"))
        self.retries = int(retries if retries is not None else setting(cfg, "openai.retries"))
        self.backoff_s = float(backoff_s if backoff_s is not None else setting(cfg, "openai.backoff_s"))
        key = api_key or setting(cfg, "openai.api_key")
        self._client = httpx.Client(
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(self.timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=self.concurrency * len(self.urls) + 4),
            # A proxy from the environment must not capture requests to local servers.
            trust_env=not all(_is_loopback(u) for u in self.urls))
        self.requests_per_url = {u: 0 for u in self.urls}  # successful requests, for logs and tests
        self._stats_lock = threading.Lock()
        self.served = self._check_servers()
        self.model = self._pick_model(model)
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer(model)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self._score_mode = "prompt_logprobs"  # falls back to echo for servers without it

    # ---------------------------------------------------------------- start-up checks
    def _check_servers(self) -> dict[str, dict]:
        """GET /models on every URL: a server that is down fails here, clearly, before any work."""
        import httpx

        served: dict[str, dict] = {}
        for url in self.urls:
            try:
                r = self._client.get(f"{url}/models", timeout=10.0)
            except httpx.HTTPError as e:
                raise UserError(f"openai backend: cannot reach {url} ({type(e).__name__}: {e}); is the server "
                                "running? (start one with `python -m vllm.entrypoints.openai.api_server "
                                "--model DIR`)") from e
            if r.status_code != 200:
                raise UserError(f"openai backend: {url}/models answered HTTP {r.status_code}: {r.text[:200]}")
            for m in r.json().get("data", []):
                served.setdefault(m["id"], m)
                served[m["id"]].setdefault("_urls", set()).add(url)
        return served

    def _pick_model(self, model: str | None) -> str:
        candidates = []
        if model:
            candidates.append(str(model))
            try:
                from gsm8kctl.artifacts.models import resolve_model

                candidates.append(resolve_model(str(model)))
            except UserError:
                pass
        for c in candidates:
            for mid, m in self.served.items():
                if c in (mid, m.get("root")) and m["_urls"] == set(self.urls):
                    return mid
        everywhere = [mid for mid, m in self.served.items() if m["_urls"] == set(self.urls)]
        if len(everywhere) == 1 and (not model or len(self.served) == 1):
            return everywhere[0]
        listing = "; ".join(f"{mid} on {', '.join(sorted(m['_urls']))}" for mid, m in self.served.items())
        raise UserError(f"openai backend: model '{model}' is not served by all of {', '.join(self.urls)} "
                        f"(served: {listing or 'nothing'})")

    def _load_tokenizer(self, model: str | None):
        tried = []
        for source in (model, self.served[self.model].get("root"), self.model):
            if not source or source in tried:
                continue
            tried.append(source)
            try:
                from gsm8kctl.artifacts.models import resolve_model

                return load_tokenizer(resolve_model(source))
            except Exception:  # noqa: BLE001 - try the next source
                continue
        raise UserError(f"openai backend: cannot load a tokenizer from {', '.join(tried)}; pass --model "
                        "with the local model directory the server was started on")

    # ---------------------------------------------------------------- HTTP with retries
    def _post(self, index: int, path: str, body: dict, stop: threading.Event) -> dict:
        import httpx

        last = ""
        for attempt in range(self.retries + 1):
            if stop.is_set():
                raise _Retryable("cancelled")
            url = self.urls[(index + attempt) % len(self.urls)]
            try:
                r = self._client.post(f"{url}{path}", json=body)
                if r.status_code == 200:
                    with self._stats_lock:
                        self.requests_per_url[url] += 1
                    return r.json()
                if r.status_code not in RETRY_STATUS:
                    raise UserError(f"{url}{path}: HTTP {r.status_code}: {r.text[:300]}")
                last = f"{url}: HTTP {r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                last = f"{url}: {type(e).__name__}: {e}"
            if attempt < self.retries:
                # Exponential backoff with jitter so retries from many threads do not march in step.
                stop.wait(self.backoff_s * (2 ** attempt) * (0.5 + random.random()))
        raise UserError(f"openai backend: request failed after {self.retries + 1} attempts; last error: {last}")

    def _map(self, fn: Callable[[int, threading.Event], Any], count: int) -> list:
        """Run fn(i, stop) for i < count with bounded concurrency; all results or the first error."""
        if count == 0:
            return []
        stop = threading.Event()
        results: list = [None] * count
        pool = ThreadPoolExecutor(max_workers=min(count, self.concurrency * len(self.urls)),
                                  thread_name_prefix="openai")
        try:
            futures = {pool.submit(fn, i, stop): i for i in range(count)}
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    raise f.exception()
                results[futures[f]] = f.result()
        except BaseException:  # an error, or Ctrl-C: return at once, drop queued requests
            stop.set()  # requests in flight end on their own; their results are discarded
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return results

    # ---------------------------------------------------------------- sampling
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        extra = {k: v for k, v in params.extra.items() if k in PASSTHROUGH_EXTRA}

        def one(i: int, stop: threading.Event) -> list[Completion]:
            body = {"model": self.model, "prompt": list(prompts[i]), "n": params.n,
                    "temperature": params.temperature, "top_p": params.top_p, "max_tokens": params.max_tokens,
                    "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True,
                    "stop_token_ids": self.stop_ids, "skip_special_tokens": True, **extra}
            seed = seed_of_request(params, i)
            if seed is not None:
                body["seed"] = seed
            t0 = time.perf_counter()
            data = self._post(i, "/completions", body, stop)
            latency = time.perf_counter() - t0
            return [self._completion(c, latency) for c in sorted(data["choices"], key=lambda c: c["index"])]

        out = self._map(one, len(prompts))
        for i, comps in enumerate(out):
            if len(comps) != params.n:
                raise UserError(f"openai backend: server returned {len(comps)} choices for prompt {i}, "
                                f"asked for n={params.n}")
        return out

    def _completion(self, choice: dict, latency: float) -> Completion:
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens")
        if tokens is None:
            raise UserError("openai backend: the server returned no logprobs; it must support `logprobs`")
        ids = [_token_id(t) for t in tokens]
        if choice.get("token_ids") is not None and list(choice["token_ids"]) != ids:
            raise UserError("openai backend: token_ids and logprob tokens disagree in the server's answer")
        logprobs = [float(x) for x in lp.get("token_logprobs", [])]
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise UserError(f"openai backend: unexpected finish_reason '{finish}'")
        return Completion(ids, logprobs, finish, self.tokenizer.decode(ids, skip_special_tokens=True), latency)

    # ---------------------------------------------------------------- scoring
    def score(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[list[float]]:
        """Log-probs of completion tokens from `prompt_logprobs` on prompt+completion (one token is
        generated and discarded); servers without it are asked with `echo` + `logprobs` instead.
        Each request scores one sequence, so server memory stays bounded per request."""

        def one(i: int, stop: threading.Event) -> list[float]:
            p, c = list(prompts[i]), list(completions[i])
            if not c:
                return []
            if not p:
                raise UserError("score: an empty prompt leaves the first token without context")
            ids = p + c
            if self._score_mode == "prompt_logprobs":
                body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                        "prompt_logprobs": 0, "return_tokens_as_token_ids": True}
                choice = self._post(i, "/completions", body, stop)["choices"][0]
                pl = choice.get("prompt_logprobs")
                if pl is not None:
                    return [_entry_logprob(pl[pos], ids[pos]) for pos in range(len(p), len(ids))]
                self._score_mode = "echo"
            body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "echo": True,
                    "logprobs": 0, "return_tokens_as_token_ids": True}
            lp = self._post(i, "/completions", body, stop)["choices"][0]["logprobs"]
            got = [_token_id(t) for t in lp["tokens"][:len(ids)]]
            if got != ids:
                raise UserError("openai backend: echoed tokens differ from the scored ids")
            return [float(x) for x in lp["token_logprobs"][len(p):len(ids)]]

        return self._map(one, len(prompts))

    def close(self) -> None:
        self._client.close()


def _entry_logprob(entry: dict | None, token: int) -> float:
    """One `prompt_logprobs` position: {"<id>": {"logprob": ...}} (vLLM serialises ids as keys)."""
    if not entry:
        raise UserError("openai backend: the server returned no prompt log-prob for a scored position")
    for key, value in entry.items():
        key_id = _token_id(key) if isinstance(key, str) and key.startswith("token_id:") else int(key)
        if key_id == token:
            return float(value["logprob"] if isinstance(value, dict) else value)
    raise UserError(f"openai backend: prompt log-probs miss token {token}")
