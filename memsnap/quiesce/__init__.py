"""Quiesce hooks: a job asks to be told before memsnapd checkpoints it (before its GPU is locked) and after
it runs again (after its CUDA state is back), so that it can suspend its NCCL communicators, drop caches it
can rebuild, or flush. Any job may opt in, CPU-only or not.

Protocol (version 1; docs in README "Quiesce hooks"):

    job (each process that opts in)                    memsnapd (checkpoint, restore, a move's rollback)
    listen on $MEMSNAP_QUIESCE_DIR/<name>.sock
                                                       finds the sockets: the tree's environments name the
                                                       dir; reached through /proc/<pid>/root, no symlink
                                                       followed; the listener must be a process of the tree
                     <- {"memsnap": 1, "event": "quiesce", "checkpoint": ID, "deadline_s": T}
    (suspend NCCL, drop caches, flush)
    {"ok": true}  or  {"ok": false, "error": "..."} ->  then the job closes; memsnapd waits for that EOF
                                                       (no half-open socket goes into the image)
                                                       [GPU lock + checkpoint, CRIU dump, publish ...]
                     <- {"memsnap": 1, "event": "resume", "checkpoint": ID, "restored": bool, "deadline_s": T}
    (rebuild communicators)  {"ok": true} ->           restored: this copy was restored from the image
                                                       (maybe on another node); false: the same process
                                                       runs on (leave-running, a failed dump, a move that
                                                       did not happen)

Every listener is asked at once; memsnapd waits up to the job's deadline (MEMSNAP_QUIESCE_TIMEOUT_S, default
30 s, at most 600). A refusal ({"ok": false}) refuses the checkpoint. No answer in time: refuse (the default)
or proceed, as MEMSNAP_QUIESCE_ON_TIMEOUT=refuse|proceed in the job's environment says. Either way every
listener asked is told to resume before the refusal is returned (FAILED_PRECONDITION). memsnapd journals a
quiesce in the checkpoint's record first, so a daemon killed before the resume tells the job at restart.

Why a socket the job listens on (and not a signal plus an ack file, or a socket memsnapd owns):
  * a signal carries no payload (quiesce or resume, which checkpoint, the deadline), collides with the job's
    own handlers (Slurm and many launchers use SIGUSR1/SIGTERM), and reaches a Python job only between
    bytecodes of its main thread; an ack file needs polling, a file per process and cleanup;
  * a connection memsnapd owned and the job kept open would be dumped with the job, half of it outside;
    here each request is one short connection, closed before CRIU starts;
  * the listening socket lives in the job's own /tmp (private, in its mount namespace: memsnapd reaches it
    through /proc/<pid>/root) and CRIU dumps and restores it with the job, so a restored copy, on this node
    or another, is reached at the same path and its listener thread simply accepts the next request;
  * the cost: a listening socket and a thread in each process that opts in (memsnap.quiesce.job does it),
    and sockets are found through the environment, so a process must be started with MEMSNAP_QUIESCE_DIR
    (memsnapctl run sets it; an adopted process sets it itself).
memsnap.quiesce.torchdist makes it one call for torch.distributed jobs (destroy and re-create the process
group at an agreed step boundary).
"""

from memsnap.quiesce.protocol import (
    DEFAULT_TIMEOUT_S,
    ENV_DIR,
    ENV_ON_TIMEOUT,
    ENV_TIMEOUT,
    MAX_TIMEOUT_S,
    Policy,
    default_dir,
)

__all__ = ["DEFAULT_TIMEOUT_S", "ENV_DIR", "ENV_ON_TIMEOUT", "ENV_TIMEOUT", "MAX_TIMEOUT_S", "Policy", "default_dir"]
