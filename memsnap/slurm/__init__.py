"""Slurm integration: a job-side launcher that checkpoints on preemption and restores on requeue,
plus the node hooks (prolog/epilog) that keep memsnapd up and clean up after finished jobs.

Everything here talks to memsnapd through the typed client (memsnap.client), never the engine.
"""
