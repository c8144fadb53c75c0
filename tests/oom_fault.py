"""A fault for out-of-memory tests, loaded into a real `gsm8kctl` subprocess as `sitecustomize`
(the test puts this file's folder on PYTHONPATH under that name).

GSM8KCTL_TEST_OOM="WHERE:ROWS:TIMES[:KIND][,...]" makes WHERE raise torch.OutOfMemoryError on
its first TIMES calls (-1 = every call) that carry more than ROWS rows, as an allocator would
fail on batches above a size. KIND `cublas` raises instead the RuntimeError that cuBLAS gives
when it cannot allocate its handle or workspace (seen on a full GPU). WHERE is `train` (the
trainer's loss over a micro-batch), `score` (the transformers backend's scoring), `sample` (the transformers
backend's batched decode) or `slots` (making the slot engine's KV pool, ROWS = slots).
"""

import os

spec = os.environ.get("GSM8KCTL_TEST_OOM")


def _fault(where: str, rows: str, times: str, kind: str = "torch"):
    import torch

    left = {"n": int(times)}

    def fail(n_rows: int) -> None:
        if n_rows > int(rows) and left["n"] != 0:
            left["n"] -= 1
            if kind == "cublas":
                raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
            raise torch.OutOfMemoryError(f"injected: {n_rows} rows > {rows} ({where})")

    return fail


def _install(where: str, fail) -> None:
    if where == "train":
        from gsm8kctl.training import losses

        real_loss = losses.policy_loss

        def policy_loss(new, *args, **kwargs):
            fail(new.shape[0])
            return real_loss(new, *args, **kwargs)

        losses.policy_loss = policy_loss
    elif where in ("score", "sample"):
        from gsm8kctl.sampling.backends.transformers import TransformersBackend

        name = "score" if where == "score" else "_decode"
        real = getattr(TransformersBackend, name)

        def wrapped(self, prompts, *args, **kwargs):
            fail(len(prompts))
            return real(self, prompts, *args, **kwargs)

        setattr(TransformersBackend, name, wrapped)
    elif where == "slots":
        from gsm8kctl.sampling.backends.slots import SlotEngine

        real_init = SlotEngine.__init__

        def init(self, model, *args, **kwargs):
            fail(kwargs["slots"])
            real_init(self, model, *args, **kwargs)

        SlotEngine.__init__ = init
    else:
        raise SystemExit(f"oom_fault: unknown WHERE {where!r}")


if spec:
    for part in spec.split(","):
        where, *args = part.split(":")
        _install(where, _fault(where, *args))
