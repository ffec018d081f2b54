"""Errors of the control plane: each message names what failed and what to do about it."""


class ControlError(RuntimeError):
    """The control plane cannot work: Redis unreachable, a refused password, a port in use, a missing binary."""


class RendezvousError(ControlError):
    """A worker could not join the run: it arrived late or twice, the world sizes disagree, or a wait timed out."""
