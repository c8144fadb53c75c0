"""gsm8kctl: rejection sampling and REINFORCE-style RL for GSM8k, one rerunnable stage at a time."""

__version__ = "0.1.0"
