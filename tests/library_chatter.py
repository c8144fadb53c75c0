"""Library output for tests, loaded into real `gsm8kctl` processes as `sitecustomize` (the test
puts this file's folder on PYTHONPATH under that name).

With GSM8KCTL_TEST_CHATTER set, every sampling call (in the loop's process or a stage's) first
prints the way libraries do: a line on stdout and on stderr, a FutureWarning, a logging warning,
each carrying the marker CHATTER. With GSM8KCTL_TEST_CHATTER=fail the call then fails, as a
library's crash would.
"""

import os

if os.environ.get("GSM8KCTL_TEST_CHATTER"):
    import logging
    import sys
    import warnings

    from gsm8kctl.sampling.backends.transformers import TransformersBackend

    real = TransformersBackend.generate_iter

    def generate_iter(self, *args, **kwargs):
        print("CHATTER on stdout", flush=True)
        print("CHATTER on stderr", file=sys.stderr, flush=True)
        warnings.warn("CHATTER as a FutureWarning", FutureWarning)
        logging.getLogger("somelibrary").warning("CHATTER as a log record")
        if os.environ["GSM8KCTL_TEST_CHATTER"] == "fail":
            raise RuntimeError("the library failed")
        return real(self, *args, **kwargs)

    TransformersBackend.generate_iter = generate_iter
