"""Stand-in for transformer_engine.common.recipe (see transformer_engine/__init__.py)."""

from dataclasses import dataclass


@dataclass
class Float8CurrentScaling:
    """One scale per tensor, from its amax at the time it is cast."""
