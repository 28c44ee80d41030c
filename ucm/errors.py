"""Error taxonomy: ``ValueError``/``TypeError`` for caller mistakes (bad config, bad arguments);
the :class:`UcmError` family for runtime and storage faults. Storage faults on the load path
never reach the engine as exceptions: they become failed blocks (cache misses) in task results.
"""


class UcmError(RuntimeError):
    """Base of ucm's runtime errors."""


class StorageError(UcmError):
    """A tier could not complete an operation (I/O error, disk full, permission)."""


class CorruptBlockError(StorageError):
    """A stored block failed a check (header, namespace, length or checksum)."""


class TaskTimeoutError(UcmError, TimeoutError):
    """``wait`` gave up before the task finished; the task keeps running."""
