"""A pytest plugin: run each selected test N times in a row (`--repeat N`), to show a test is not flaky.

Not loaded by default (pytest collects only test_*.py); name it with `-p`, tests/ on the path:

    PYTHONPATH=tests .venv/bin/python -m pytest -p pytest_repeat --repeat 10 \
        tests/test_vllm_backend.py::test_seeds tests/test_openai_backend.py::test_generate_token_exact

The repeats of a test run back to back, so module-scoped fixtures (a vLLM engine, servers) start
once per module, as in a normal run. A run fails if any repeat fails.
"""

from __future__ import annotations


def pytest_addoption(parser):
    parser.addoption("--repeat", type=int, default=1, help="run each selected test N times in a row")


def pytest_generate_tests(metafunc):
    # Each repeat is its own parametrized test (test_x[repeat-3]): fresh function-scoped fixtures,
    # shared module-scoped ones, ordered back to back.
    n = metafunc.config.getoption("repeat")
    if n > 1:
        metafunc.fixturenames.append("repeat")
        metafunc.parametrize("repeat", range(n), ids=lambda k: f"repeat-{k}")
