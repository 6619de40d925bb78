"""Exception types parallm raises (the same type on every rank, see parallm.parallel.errors.agree)."""


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: missing / unexpected / mis-shaped tensor, unreadable files."""


class ParallelError(RuntimeError):
    """Another rank failed (with an error type that is not re-created by name); the message names the rank."""
