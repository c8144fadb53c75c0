"""Sampling: the attempts core (prompts, grading, writing tapes as they finish) and one module
per backend under `backends/`. Imports training.logprobs (the log-prob math), config, artifacts
and the leaves.
"""
