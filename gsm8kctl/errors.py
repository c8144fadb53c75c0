"""The one place where exceptions become exit codes."""


class UserError(Exception):
    """Bad input from the user: printed as one line on stderr, exit code 2, no traceback."""


class StageFailed(Exception):
    """A child (a stage, a training worker) failed or died: one line on stderr, exit code 1."""


class Stopped(Exception):
    """The work stopped on purpose for the reason the message gives (an RL loop with nothing to
    learn from, say): one line on stderr, exit code 1, and the run directory resumable."""


EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
