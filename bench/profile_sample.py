"""Where one `gsm8kctl sample` (or `evaluate`) process spends its wall time, phase by phase.

Runs the command in this process, as `python -m gsm8kctl` would, with timestamps at the phase
boundaries (wrapped from outside; the product code only keeps counters in the slot engine):
imports of torch and the backend, model load (with transformers' imports when the model is
Hugging Face's module: `transformers_imported` in the JSON), prompts until the first decode, the
engine's run (split by its own counters into window syncs, admissions and the rest), the writer
draining after the last completion, and close. Prints a table and writes JSON.

    python bench/profile_sample.py --out sample.json -- sample --model M --backend transformers \
        -q -o /tmp/t/tapes.jsonl --n-problems 1024 --attempts 8 --temperature 1.0 --max-tokens 512
    python bench/profile_sample.py --out eval.json -- evaluate --model M --backend transformers -q -o /tmp/e --json

`--no-gate` runs the same command with the host gate (gsm8kctl/sampling/hostgate.py) never shut: the
writer thread free-running beside the sampler, as it was before the gate. `--no-overlap` runs
the slot engine's windows one after the other (the host reads each window's tokens before it
launches the next), as before overlapped windows. `--sdpa-default` lets torch choose SDPA's
backend for the prefill and scoring forwards (cuDNN included), as before `slots.SDPA_BACKENDS`.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # before anything heavy: the process's own start is not counted

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

marks: dict[str, float] = {}


def mark(name: str) -> None:
    marks.setdefault(name, time.perf_counter() - T0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-gate", action="store_true",
                    help="the host gate never shuts (the writer thread runs free, as before hostgate.py)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="the slot engine launches a window only after reading the last one's tokens")
    ap.add_argument("--sdpa-default", action="store_true",
                    help="torch chooses SDPA's backend (cuDNN included), as before slots.SDPA_BACKENDS")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the gsm8kctl command line")
    a = ap.parse_args()
    argv = a.command[1:] if a.command[:1] == ["--"] else a.command

    import gsm8kctl.cli as cli  # typer, our modules; torch not yet
    mark("cli imported")
    if a.no_gate:
        from gsm8kctl.sampling.hostgate import HostGate

        HostGate.held = lambda self: contextlib.nullcontext(self)
        HostGate.released = lambda self: contextlib.nullcontext()
    if a.no_overlap:
        import functools

        from gsm8kctl.sampling.backends import slots

        slots.SlotEngine.__init__ = functools.partialmethod(slots.SlotEngine.__init__, overlap=False)
    if a.sdpa_default:
        from gsm8kctl.sampling.backends import slots

        slots.SDPA_BACKENDS = None
    from gsm8kctl.sampling import attempts

    engine_stats: dict = {}
    opened = attempts.open_backend

    def open_backend(*args, **kwargs):
        import torch  # noqa: F401
        mark("torch imported")
        import gsm8kctl.sampling.backends.transformers as tb  # our backend (transformers itself only if the model needs it)
        mark("backend imported")
        run, close = tb.SlotEngine.run, tb.TransformersBackend.close

        def timed_run(self, *r_args, **r_kwargs):
            mark("engine run starts")
            for item in run(self, *r_args, **r_kwargs):
                mark("first completion")
                yield item
            mark("engine run ends")

        def timed_close(self):
            mark("close starts")
            if self._engine is not None:
                engine_stats.update(self._engine.stats, slots=self._engine.slots, max_len=self._engine.max_len)
            close(self)

        tb.SlotEngine.run, tb.TransformersBackend.close = timed_run, timed_close
        backend = opened(*args, **kwargs)
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        mark("model loaded")
        return backend

    attempts.open_backend = open_backend
    for mod in ("gsm8kctl.stages.sample", "gsm8kctl.stages.evaluate"):  # they imported it by name
        m = sys.modules.get(mod) or __import__(mod, fromlist=["x"])
        if hasattr(m, "open_backend"):
            m.open_backend = open_backend
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        try:
            cli.app(args=argv, standalone_mode=False)
        except SystemExit as e:
            if e.code:
                raise
    mark("command returns")
    order = ["cli imported", "torch imported", "backend imported", "model loaded",
             "engine run starts", "first completion", "engine run ends", "close starts", "command returns"]
    rows, prev = [], 0.0
    for name in order:
        if name in marks:
            rows.append({"until": name, "at_s": round(marks[name], 3), "phase_s": round(marks[name] - prev, 3)})
            prev = marks[name]
    run_s = engine_stats.get("run_s", 0.0)
    split = {k: round(engine_stats.get(k, 0.0), 3) for k in ("sync_s", "admit_s", "prefill_s", "capture_s")}
    split["rest_s"] = round(run_s - split["sync_s"] - split["admit_s"], 3)
    # Whether the process imported transformers (our decoder, backends/llama.py, needs none of it).
    result = {"argv": argv, "gate": not a.no_gate, "overlap": not a.no_overlap,
              "sdpa_default": a.sdpa_default,
              "transformers_imported": "transformers" in sys.modules, "phases": rows, "engine": engine_stats, "engine_run_split": split,
              "stdout_tail": stdout.getvalue()[-2000:]}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'until':34} {'at s':>8} {'phase s':>8}")
    for r in rows:
        print(f"{r['until']:34} {r['at_s']:8.2f} {r['phase_s']:8.2f}")
    print("engine run:", run_s and f"{run_s:.2f} s =", ", ".join(f"{k} {v}" for k, v in split.items()))
    print("engine:", {k: v for k, v in engine_stats.items() if not k.endswith("_s")})


if __name__ == "__main__":
    main()
