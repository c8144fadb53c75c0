"""A fault for out-of-memory tests, loaded into a real `gsm8kctl` subprocess as `sitecustomize`
(the test puts this file's folder on PYTHONPATH under that name).

GSM8KCTL_TEST_OOM="WHERE:ROWS:TIMES" makes WHERE raise torch.OutOfMemoryError on its first
TIMES calls (-1 = every call) that carry more than ROWS rows, as an allocator would fail on
batches above a size. WHERE is `train` (the trainer's loss over a micro-batch), `score` (the
transformers backend's scoring) or `sample` (the transformers backend's generation).
"""

import os

spec = os.environ.get("GSM8KCTL_TEST_OOM")
if spec:
    import torch

    where, rows, times = spec.split(":")
    left = {"n": int(times)}

    def _fail(n_rows: int) -> None:
        if n_rows > int(rows) and left["n"] != 0:
            left["n"] -= 1
            raise torch.OutOfMemoryError(f"injected: {n_rows} rows > {rows} ({where})")

    if where == "train":
        from gsm8kctl import losses

        real_loss = losses.policy_loss

        def policy_loss(new, *args, **kwargs):
            _fail(new.shape[0])
            return real_loss(new, *args, **kwargs)

        losses.policy_loss = policy_loss
    elif where in ("score", "sample"):
        from gsm8kctl.backends.transformers import TransformersBackend

        if where == "score":
            real_score = TransformersBackend.score

            def score(self, prompts, completions, *args, **kwargs):
                _fail(len(prompts))
                return real_score(self, prompts, completions, *args, **kwargs)

            TransformersBackend.score = score
        else:
            for name in ("generate", "generate_iter"):
                real = getattr(TransformersBackend, name, None)
                if real is None:
                    continue

                def wrapped(self, prompts, *args, _real=real, **kwargs):
                    _fail(len(prompts))
                    return _real(self, prompts, *args, **kwargs)

                setattr(TransformersBackend, name, wrapped)
