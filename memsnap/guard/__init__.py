"""The memory-pressure guard: park jobs (checkpoint --stop) instead of letting the OOM killer take them, and
resume them when memory is back. See docs/guard.md."""
