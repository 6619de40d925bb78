"""Exception types parallm raises (the same type on every rank, see parallm.parallel.errors.agree)."""


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: missing / unexpected / mis-shaped tensor, unreadable files."""


class ParallelError(RuntimeError):
    """Another rank failed (with an error type that is not re-created by name); the message names the rank."""


# Types re-created by name when one rank's error is raised on the others (parallel.errors.agree); any other type
# arrives as a ParallelError.
PORTABLE_ERRORS = {t.__name__: t for t in (CheckpointError, ParallelError, ValueError, RuntimeError,
                                           FileNotFoundError, TypeError, KeyError, OSError)}

# Errors whose message is the whole story: parallm raises them with the culprit and the numbers named (and on every
# rank alike), so reports show the message alone, without the type name or a traceback.
USER_ERRORS = frozenset(t.__name__ for t in (CheckpointError, ParallelError, ValueError, FileNotFoundError))
