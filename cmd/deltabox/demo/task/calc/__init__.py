"""calc: a tiny library with three bugs, for `deltabox demo`."""
from .ops import add, mean, clamp

__all__ = ["add", "mean", "clamp"]
