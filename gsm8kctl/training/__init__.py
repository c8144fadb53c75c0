"""Training: the trainer (`trainer.py`), the loss formulas (`losses.py`), log-probs and
packing. Imports config, artifacts and the leaves, never sampling.
"""
