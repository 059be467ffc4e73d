"""areal-cli: asynchronous RL for language models, driven from one CLI."""

__version__ = "0.1.0"
