"""memsnap: transparent whole-process checkpoints into a memory tier, drained asynchronously to storage."""

__version__ = "0.1.0"
