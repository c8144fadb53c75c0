"""`gsm8kctl browse`: a local, read-only web page over tapes files and `llm_calls.sqlite`."""

from gsm8kctl.browse.app import create_app

__all__ = ["create_app"]
