"""One training loop shared by every trainer, and thin trainers per family."""

from tether.trainers.loop import NonFiniteError, Trainer

__all__ = ["NonFiniteError", "Trainer"]
