"""The loop and what runs several stages: the driver (`driver.py`), the engines that run a
phase in this process or a child, shards, the vLLM server's lifecycle, the curriculum, the
seeds and control commands. The top floor below the CLI: it calls the stages' public functions.
"""
