"""Typed gRPC client with deadlines: used by memsnapctl, Slurm hooks and peer daemons."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from memsnap.v1 import memsnap_pb2 as pb
from memsnap.v1 import memsnap_pb2_grpc as pb_grpc

DEFAULT_SOCKET = "/run/memsnap/memsnapd.sock"
# Checkpoints of big jobs take a while; quick calls must fail fast when the daemon is gone.
QUICK_S = 10.0
LONG_S = 3600.0


class ClientError(Exception):
    """A failed call: the gRPC status name plus the daemon's one-line message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}")


@dataclass
class Target:
    """Where the daemon is: a Unix socket, or HOST:PORT with a token and/or TLS."""

    socket: str = ""
    address: str = ""
    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def channel_for(t: Target) -> grpc.Channel:
    """A channel to the daemon (Unix socket, or TCP with optional TLS)."""
    opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    if t.address:
        if t.tls_ca:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(t.tls_ca),
                private_key=_read(t.tls_key) if t.tls_key else None,
                certificate_chain=_read(t.tls_cert) if t.tls_cert else None,
            )
            return grpc.secure_channel(t.address, creds, options=opts)
        return grpc.insecure_channel(t.address, options=opts)
    return grpc.insecure_channel(f"unix:{t.socket or DEFAULT_SOCKET}", options=opts)


class MemsnapClient:
    """One method per RPC; every call has a deadline and raises ClientError on failure."""

    def __init__(self, target: Target | None = None, socket: str = "") -> None:
        self.target = target or Target(socket=socket or os.environ.get("MEMSNAP_SOCKET", DEFAULT_SOCKET))
        self.channel = channel_for(self.target)
        self.stub = pb_grpc.MemsnapStub(self.channel)  # type: ignore[no-untyped-call]
        self._md = [("authorization", f"Bearer {self.target.token}")] if self.target.token else []

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()

    def __enter__(self) -> MemsnapClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: object, timeout: float) -> object:
        try:
            return getattr(self.stub, method)(request, timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            raise _client_error(exc, self.target) from None

    def status(self, timeout: float = QUICK_S, op_id: str = "") -> pb.StatusResponse:
        """Daemon status (with the progress of the caller's operation op_id, while it runs)."""
        return self._call("Status", pb.StatusRequest(op_id=op_id), timeout)  # type: ignore[return-value]

    def run(self, argv: list[str], name: str = "", cwd: str = "", env: dict[str, str] | None = None,
            timeout: float = 30.0, own_proc: bool | None = None, memory_limit: int = 0, priority: int = 0,
            critical: bool = False, on_limit: str = "", keep_last: int | None = None,
            keep_within_s: float | None = None, private_tmp: bool | None = None) -> pb.Job:
        """Starts a managed job (own_proc, private_tmp None: the node decides whether it gets its own /proc and
        /tmp); memory_limit, priority, critical and on_limit are the memory guard's; keep_last and keep_within_s
        its retention."""
        req = pb.RunJobRequest(argv=argv, name=name, cwd=cwd, env=env or {}, own_proc=own_proc,
                               private_tmp=private_tmp,
                               memory_limit_bytes=memory_limit, priority=priority, critical=critical,
                               on_limit=on_limit, keep_last=keep_last, keep_within_s=keep_within_s)
        return self._call("RunJob", req, timeout).job  # type: ignore[attr-defined,no-any-return]

    def jobs(self, timeout: float = QUICK_S) -> list[pb.Job]:
        """Managed jobs."""
        return list(self._call("ListJobs", pb.ListJobsRequest(), timeout).jobs)  # type: ignore[attr-defined]

    def checkpoint(self, target: str | int, stop: bool = False, wait_durable: bool = False,
                   tcp_established: bool = False, name: str = "", timeout: float = LONG_S,
                   keep_last: int | None = None, keep_within_s: float | None = None,
                   fail_on_in_flight: bool = False) -> pb.CheckpointInfo:
        """Checkpoints a pid or job; returns once staged (or durable). keep_last/keep_within_s set the
        retention of its checkpoints from now on; fail_on_in_flight: fail on a connection in a listener's
        accept queue (else it is left out)."""
        req = pb.CheckpointRequest(target=str(target), stop=stop, tcp_established=tcp_established, name=name,
                                   wait=pb.WAIT_FOR_DURABLE if wait_durable else pb.WAIT_FOR_STAGED,
                                   keep_last=keep_last, keep_within_s=keep_within_s,
                                   fail_on_in_flight=fail_on_in_flight)
        return self._call("Checkpoint", req, timeout).checkpoint  # type: ignore[attr-defined,no-any-return]

    def restore(self, checkpoint_id: str, lazy: bool = False, gpu_map: dict[str, str] | None = None,
                tcp_established: bool = False, timeout: float = LONG_S, op_id: str = "",
                into: str = "") -> pb.RestoreResponse:
        """Restores a checkpoint (or a job's latest one); op_id names it for Status(op_id); into: a container's
        checkpoint goes into a new placeholder container ("podman:NAME")."""
        req = pb.RestoreRequest(checkpoint_id=checkpoint_id, lazy=lazy, gpu_map=gpu_map or {},
                                tcp_established=tcp_established, op_id=op_id, into=into)
        return self._call("Restore", req, timeout)  # type: ignore[return-value]

    def list(self, job: str = "", timeout: float = QUICK_S) -> list[pb.CheckpointInfo]:
        """Checkpoints, oldest first."""
        resp = self._call("ListCheckpoints", pb.ListCheckpointsRequest(job=job), timeout)
        return list(resp.checkpoints)  # type: ignore[attr-defined]

    def show(self, ckpt_id: str, timeout: float = QUICK_S) -> pb.CheckpointInfo:
        """One checkpoint."""
        resp = self._call("GetCheckpoint", pb.GetCheckpointRequest(id=ckpt_id), timeout)
        return resp.checkpoint  # type: ignore[attr-defined,no-any-return]

    def delete(self, ckpt_id: str, timeout: float = 60.0) -> pb.DeleteCheckpointResponse:
        """Deletes a checkpoint everywhere (a stored copy another node owns stays: note says so)."""
        return self._call("DeleteCheckpoint", pb.DeleteCheckpointRequest(id=ckpt_id), timeout)  # type: ignore[return-value]

    def evict(self, ckpt_id: str, timeout: float = 60.0) -> pb.CheckpointInfo:
        """Drops the tier copy of a durable checkpoint."""
        resp = self._call("EvictCheckpoint", pb.EvictCheckpointRequest(id=ckpt_id), timeout)
        return resp.checkpoint  # type: ignore[attr-defined,no-any-return]

    def watch(self, ckpt_id: str, timeout: float = LONG_S) -> Iterator[pb.CheckpointInfo]:
        """Progress updates until durable or failed."""
        try:
            yield from self.stub.WatchCheckpoint(pb.WatchCheckpointRequest(id=ckpt_id), timeout=timeout,
                                                 metadata=self._md)
        except grpc.RpcError as exc:
            raise _client_error(exc, self.target) from None

    def migrate(self, req: pb.MigrateRequest, timeout: float = LONG_S) -> pb.MigrateResponse:
        """Moves a job to another daemon."""
        return self._call("Migrate", req, timeout)  # type: ignore[return-value]

    def stop_job(self, job: str, timeout_s: float = 10.0, kill: bool = False,
                 timeout: float = 60.0) -> pb.StopJobResponse:
        """Ends a job: SIGTERM, then SIGKILL after timeout_s (kill: SIGKILL at once)."""
        req = pb.StopJobRequest(job=job, timeout_s=timeout_s, kill=kill)
        return self._call("StopJob", req, timeout)  # type: ignore[return-value]

    def resume_job(self, job: str, memory_limit: int = 0, timeout: float = LONG_S,
                   op_id: str = "") -> pb.RestoreResponse:
        """Resumes a job the memory guard parked (memory_limit 0: its old limit); op_id names it for Status."""
        req = pb.ResumeJobRequest(job=job, memory_limit_bytes=memory_limit, op_id=op_id)
        return self._call("ResumeJob", req, timeout)  # type: ignore[return-value]


    def delete_job(self, job: str, force: bool = False, timeout: float = 60.0) -> pb.Job:
        """Forgets an ended job and removes its log."""
        return self._call("DeleteJob", pb.DeleteJobRequest(job=job, force=force),  # type: ignore[attr-defined,no-any-return]
                          timeout).job

    def prune(self, dry_run: bool = False, timeout: float = 600.0) -> pb.PruneResponse:
        """Removes ended jobs and failed checkpoints."""
        return self._call("Prune", pb.PruneRequest(dry_run=dry_run), timeout)  # type: ignore[return-value]

    def gc(self, dry_run: bool = False, timeout: float = 3600.0) -> pb.GcResponse:
        """Applies the retention policy and sweeps unreferenced store chunks (root); dry_run only reports."""
        return self._call("Gc", pb.GcRequest(dry_run=dry_run), timeout)  # type: ignore[return-value]

    def job_logs(self, job: str, follow: bool = False, tail_bytes: int = 0,
                 timeout: float | None = None) -> Iterator[pb.LogChunk]:
        """A job's output in chunks (follow: until the job ends)."""
        try:
            yield from self.stub.JobLogs(pb.JobLogsRequest(job=job, follow=follow, tail_bytes=tail_bytes),
                                         timeout=timeout if timeout is not None else (None if follow else LONG_S),
                                         metadata=self._md)
        except grpc.RpcError as exc:
            raise _client_error(exc, self.target) from None


def _client_error(exc: grpc.RpcError, target: Target | None = None) -> ClientError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    # Only grpc's own failure to reach *this* daemon gets a local hint; an UNAVAILABLE the daemon relays
    # (a peer it could not reach during a move) keeps its own words.
    if code == grpc.StatusCode.UNAVAILABLE and (not details or details.startswith("failed to connect")):
        if target is not None and not target.address:
            return _socket_error(target.socket or DEFAULT_SOCKET, details or "")
        where = f" at {target.address}" if target is not None else ""
        details = f"memsnapd{where} is not reachable ({details})"
    return ClientError(code, details or code.name)


def _socket_error(path: str, details: str) -> ClientError:
    """Why the local socket cannot be used, in words that say what to do."""
    if not os.path.exists(path):
        return ClientError(grpc.StatusCode.UNAVAILABLE,
                           f"no memsnapd socket at {path}: is memsnapd running? (systemctl status memsnapd; "
                           "--socket or MEMSNAP_SOCKET for another one)")
    if "permission denied" in details.lower() or not os.access(path, os.R_OK | os.W_OK):
        try:
            import grp

            group = grp.getgrgid(os.stat(path).st_gid).gr_name
        except (KeyError, OSError):
            group = "the socket's group"
        return ClientError(grpc.StatusCode.PERMISSION_DENIED,
                           f"permission denied on {path}: ask to be added to group {group} "
                           f"(or run as root)")
    return ClientError(grpc.StatusCode.UNAVAILABLE,
                       f"memsnapd does not answer on {path} ({details}): is it running? "
                       "(systemctl status memsnapd)")
