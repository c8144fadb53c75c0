"""The host gate (gsm8kctl/sampling/hostgate.py): a helper thread runs only while the sampler waits on
the device, and never stays shut out once sampling ends or fails."""

from __future__ import annotations

import random
import sys
import threading

from gsm8kctl.config import load_config
from gsm8kctl.sampling.backends.base import SamplingParams, completion_seeds
from gsm8kctl.sampling.backends.slots import Request, SlotEngine
from gsm8kctl.sampling.backends.transformers import TransformersBackend
from gsm8kctl.sampling.hostgate import HostGate


def _helper(gate: HostGate) -> tuple[threading.Thread, threading.Event]:
    passed = threading.Event()

    def run() -> None:
        gate.wait()
        passed.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, passed


def test_a_held_gate_stops_the_helper_until_released():
    gate = HostGate()
    interval = sys.getswitchinterval()
    with gate.held():
        assert sys.getswitchinterval() <= 0.0005
        thread, passed = _helper(gate)
        assert not passed.wait(0.3)  # shut while the sampler works on the host
        with gate.released():
            assert passed.wait(10)  # open around a device wait
        thread.join(10)
        _, later = _helper(gate)
        assert not later.wait(0.3)  # shut again after the wait
    assert later.wait(10)  # open for good once sampling ends
    assert sys.getswitchinterval() == interval


def test_an_error_inside_held_opens_the_gate():
    gate = HostGate()
    try:
        with gate.held():
            raise RuntimeError("sampling failed")
    except RuntimeError:
        pass
    _, passed = _helper(gate)
    assert passed.wait(10)


def test_the_engine_opens_the_gate_at_its_window_syncs_and_changes_no_token(tiny_model_dir):
    """On the CPU the backend leaves the gate open (no device wait to run a helper in), so this
    drives the engine itself: a helper blocked by the held gate gets through during the run,
    and the tokens are those of a run without a gate."""
    backend = TransformersBackend(tiny_model_dir, load_config(None, []), dtype="float32")
    rng = random.Random(3)
    prompts = [[rng.randrange(1000, 20000) for _ in range(rng.randrange(3, 30))] for _ in range(6)]
    params = SamplingParams(n=1, temperature=1.0, max_tokens=12, seed=4)
    seeds = completion_seeds(params, len(prompts))

    def run(gate):
        engine = SlotEngine(backend.model_obj, slots=3, max_len=64, stop_ids=backend.stop_ids,
                            pad_id=backend.pad_id, window=2)
        requests = [Request(k, prompts[k], seeds[k]) for k in range(len(prompts))]
        return {f.index: f.token_ids for f in engine.run(requests, temperature=1.0, top_p=1.0, max_tokens=12,
                                                         gate=gate)}

    gate = HostGate()
    with gate.held():
        _, passed = _helper(gate)
        gated = run(gate)
        # Still inside `held`: only the engine's window syncs can have let it through.
        assert passed.wait(10)
        _, after = _helper(gate)
        assert not after.wait(0.3)  # and the engine left the gate shut for its caller
    assert gated == run(None)
    backend.close()
