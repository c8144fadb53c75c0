"""Lifecycle of a local vLLM OpenAI-compatible server: start, wait for /health, stop, never orphan.

    with VLLMServer(model_dir, log_path=run_dir / "vllm-server.log") as srv:
        backend = OpenAIBackend(model_dir, base_url=srv.base_url)

Process layout: the server runs under the supervisor of `gsm8kctl.procs` (`start_supervised`),
which leads a new session/process group and is a child subreaper: the server and everything it
spawns (vLLM's engine core and worker) stay below it. Stopping sends TERM to the whole group,
waits `grace_s`, then KILLs it. If our process dies without stopping it (SIGKILL, crash), the
kernel sends the supervisor SIGTERM (`PR_SET_PDEATHSIG`; it also polls its parent id) and it
takes every descendant down the same way: no orphaned engine keeps a port and 5 GiB.

PR_SET_PDEATHSIG fires when the *thread* that started the server exits: start servers from a
long-lived thread (the main thread); to start several at once call `start()` on each, then
`wait_ready()` on each (that is what `__enter__` does for one).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gsm8kctl.config import setting
from gsm8kctl.config.sizes import gpu_share
from gsm8kctl.errors import UserError
from gsm8kctl.procs import free_port, group_alive, start_supervised

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HEALTH_PATH = "/health"


class ServerProcess:
    """Any HTTP server command run under the supervisor, bound to `host:port`, with a health URL."""

    def __init__(self, cmd: list[str], *, port: int, host: str = "127.0.0.1", log_path: str | Path | None = None,
                 env: dict | None = None, health_path: str = HEALTH_PATH, startup_timeout_s: float = 600,
                 grace_s: float = 15, name: str = "server"):
        self.cmd, self.port, self.host = list(cmd), port, host
        self.env = env
        self.health_path = health_path
        self.startup_timeout_s, self.grace_s = startup_timeout_s, grace_s
        self.name = name
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"gsm8kctl-{name}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self._log = None

    # ---------------------------------------------------------------- urls
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc else None  # the supervisor leads its own group

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ---------------------------------------------------------------- start
    def start(self) -> "ServerProcess":
        """Launch (non-blocking); `wait_ready()` waits for health."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab", buffering=0)
        self._log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.cmd)}\n".encode())
        self.proc = start_supervised(self.cmd, grace_s=self.grace_s, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, close_fds=True)
        self._started = time.monotonic()
        return self

    def wait_ready(self) -> "ServerProcess":
        """Poll the health URL until it answers 200; stop and raise if the deadline passes or it dies."""
        import httpx

        deadline = self._started + self.startup_timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                if not self.alive():
                    self.stop()
                    raise UserError(f"{self.name} on port {self.port} exited during start-up: "
                                    f"{self.log_tail(1)!r}; full log: {self.log_path}")
                try:
                    if client.get(self.url + self.health_path).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise UserError(f"{self.name} on port {self.port} not healthy after {self.startup_timeout_s:.0f} s; "
                                    f"log: {self.log_path}")
                time.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_bytes()[-20000:].decode(errors="replace")
        except OSError:
            return ""
        return "\n".join([ln for ln in text.splitlines() if ln.strip()][-lines:])

    # ---------------------------------------------------------------- stop
    def stop(self) -> None:
        """TERM the whole process group, KILL it after `grace_s`; idempotent."""
        if self.proc is None:
            return
        pgid = self.pgid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.grace_s + 5)
        except subprocess.TimeoutExpired:
            pass
        # The supervisor KILLs the group itself; this covers a supervisor that was killed.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        deadline = time.monotonic() + 10
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill_server(self) -> None:
        """SIGKILL the group at once, no grace: what a crashed machine looks like (tests)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)

    def __enter__(self):
        try:
            if self.proc is None:
                self.start()
            return self.wait_ready()
        except BaseException:  # KeyboardInterrupt during start-up included
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


class VLLMServer(ServerProcess):
    """`python -m vllm.entrypoints.openai.api_server` on a checkpoint directory, 127.0.0.1, free port.

    `base_url` is the OpenAI base (`http://127.0.0.1:PORT/v1`); the served model name is the
    directory path unless `served_model_name` is given. Settings come from `cfg["vllm"]`
    (dtype, enforce_eager, max_model_len, max_num_seqs, and on CPU kv_cache_gb); `env` adds to
    (and overrides) the environment; `extra_args` are appended to the command line.
    """

    def __init__(self, model_dir: str | Path, *, log_path: str | Path | None = None, env: dict | None = None,
                 cfg: dict | None = None, host: str = "127.0.0.1", port: int | None = None,
                 served_model_name: str | None = None, extra_args: list[str] | tuple = (),
                 startup_timeout_s: float = 600, grace_s: float = 15, port_retries: int = 3):
        from gsm8kctl.sampling.backends.vllm import cpu_env, engine_dtype, has_gpu

        cfg = cfg or {}
        self.model_dir = str(model_dir)
        self.served_model_name = served_model_name or self.model_dir
        self._fixed_port = port
        self._port_retries = port_retries
        full_env = dict(os.environ)
        if not has_gpu():
            full_env.update(cpu_env(cfg, base=full_env))
        full_env.setdefault("TOKENIZERS_PARALLELISM", "false")
        full_env.update(env or {})
        self._args = ["--model", self.model_dir, "--served-model-name", self.served_model_name,
                      "--host", host, "--dtype", engine_dtype(str(setting(cfg, "vllm.dtype"))),
                      "--logprobs-mode", "raw_logprobs", "--generation-config", "vllm",
                      "--seed", str(int(setting(cfg, "seed")))]
        if setting(cfg, "vllm.enforce_eager"):
            self._args.append("--enforce-eager")
        for key, flag in (("max_model_len", "--max-model-len"), ("max_num_seqs", "--max-num-seqs")):
            if setting(cfg, f"vllm.{key}"):
                self._args += [flag, str(int(setting(cfg, f"vllm.{key}")))]
        if has_gpu():
            share = round(float(setting(cfg, "vllm.gpu_memory_utilization")) * gpu_share(cfg), 4)  # of the whole GPU
            self._args += ["--gpu-memory-utilization", str(share)]
        else:
            self._args.append("--no-enable-chunked-prefill")  # see CPU_ENGINE_ARGS in backends/vllm.py
        self._args += list(extra_args)
        chosen = port or free_port(host)
        super().__init__(self._command(chosen), port=chosen, host=host, log_path=log_path, env=full_env,
                         startup_timeout_s=startup_timeout_s, grace_s=grace_s, name="vllm-server")

    def _command(self, port: int) -> list[str]:
        return [sys.executable, "-m", SERVER_MODULE, *self._args, "--port", str(port)]

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def wait_ready(self) -> "VLLMServer":
        for attempt in range(self._port_retries + 1):
            try:
                return super().wait_ready()
            except UserError:
                # Another process may have taken the free port between our probe and its bind.
                if self._fixed_port or attempt == self._port_retries or "address already in use" not in \
                        self.log_tail(50).lower():
                    raise
                self.port = free_port(self.host)
                self.cmd = self._command(self.port)
                self.proc = None
                self.start()
        raise AssertionError("unreachable")
