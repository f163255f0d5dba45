"""cachex-agent: a checkpoint tier beside unchanged training code."""

__version__ = "0.1.0"
