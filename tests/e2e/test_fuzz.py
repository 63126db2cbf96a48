"""Fuzzing the API edge: seeded random and mutated requests over every RPC, as root and as uid 65534.

Expected: no INTERNAL (a bug) and no UNKNOWN (an exception that escaped), the daemon never dies, and it
answers Status after every batch. The generator is seeded (MEMSNAP_FUZZ_SEED, default below), so a
failure prints the seed and the request that caused it, and reproduces.

Nothing expensive starts: commands never exist (so RunJob fails in the trampoline), numeric targets are
never a real small pid (refused ones like 1 and the daemon's own pid aside), and names and ids match
nothing real. Every reply carries a message short enough for gRPC metadata.

Raw bytes too (fuzz_raw): a channel without serializers sends every method of both services (and health,
reflection) bytes that are no request message: random bytes, truncated varints, wrong wire types, huge length
prefixes, deep groups, bad UTF-8, mutated valid requests. Each must get INVALID_ARGUMENT with one line saying
what to do (grpcio's own answer was INTERNAL "Exception deserializing request!"), in time, the daemon alive.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, DaemonProc

SEED = int(os.environ.get("MEMSNAP_FUZZ_SEED", "20261130"))
PER_CALLER = int(os.environ.get("MEMSNAP_FUZZ_REQUESTS", "5000"))
RAW_PER_CALLER = int(os.environ.get("MEMSNAP_FUZZ_RAW", "1200"))
BATCH = 500
BAD = {"INTERNAL", "UNKNOWN"}

BASES = ["", "x", "job-deadbeef", "ck-20260101-000000-abcdef", "fuzz-name", "0:fuzz", "65534:fuzz",
         "4294967295:x", "99999999999:x", "²", "١٢٣", "１２", "-1", "0", "1", "2", "3999999", "4194305",
         "18446744073709551616", "../../etc/passwd", "/tmp", ".hidden", "a/b", "名前", "\U0001F600", " x ",
         "x\x00y", "A=B", "=", "127.0.0.1:1", "[::1]:1", "host:99999", "10.0.0.1/24", "eth0", "lo",
         "slurm-1", "UID:NAME", ":", "0:", ":x", "\u202e", "\x7f", "\t", "job-", "ck-", "%s%n", "${PATH}"]
# Well-formed values that match nothing real.
VALID = ["", "fuzz-name", "fz.1", "job-0badc0de", "ck-20260101-000000-abcdef", "0:fuzz-name", "65534:fuzz-name",
         "4000001", "127.0.0.1:9", "10.255.255.1/32", "lo", "fz-" + "a" * 100]
INSERTS = ["\x00", "=", ":", "/", " ", "\n", "²", "\u202e", "\x7f", "..", "\\", "'", '"', "*", "\U0001F600"]
INTS = [0, 1, 2, 255, 4096, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63,
        (1 << 64) - 1]


class Gen:
    """Seeded requests for every RPC."""

    def __init__(self, seed: int, daemon_pid: int) -> None:
        self.r = random.Random(seed)
        self.daemon_pid = daemon_pid
        self.plain = False  # this request's strings are all well-formed (they reach the engine)

    def s(self, *extra: str) -> str:
        r = self.r
        if self.plain:
            return r.choice(VALID)
        v = r.choice(BASES + list(extra))
        for _ in range(r.choice([0, 0, 0, 1, 1, 2, 3])):
            op = r.randrange(6)
            if op == 0:
                i = r.randrange(len(v) + 1)
                v = v[:i] + r.choice(INSERTS) + v[i:]
            elif op == 1:
                v = v * r.choice([2, 10, 100, 2000])
            elif op == 2:
                v = v[: r.randrange(len(v) + 1)]
            elif op == 3:
                v = "".join(chr(r.choice([r.randrange(32, 127), r.randrange(0x80, 0xD7FF)]))
                            for _ in range(r.randrange(1, 40)))
            elif op == 4:
                v = str(r.choice(INTS + [r.randrange(3_000_000, 4_000_000)])) + v
            else:
                v = "x" * r.choice([201, 4097, 17000, 70000])
            v = v[:100_000]
        return v

    def target(self) -> str:
        """A pid, id or name that is never a real process the fuzzer could hurt (1, 2 and the daemon's pid
        are refused before anything happens)."""
        t = self.r.choice([self.s(), self.s(), str(self.daemon_pid), "1", "2",
                           str(self.r.randrange(3_000_000, 4_000_000))])
        core = t.strip()
        if core.isascii() and core.isdigit() and len(core) < 12 and 3 <= int(core) < 3_000_000 \
                and int(core) != self.daemon_pid:
            return "fz" + t
        return t

    def n(self) -> int:
        return self.r.choice(INTS + [self.r.randrange(1 << 20)])

    def b(self) -> bool:
        return self.r.random() < 0.5

    def smap(self, keys: Callable[[], str] | None = None) -> dict[str, str]:
        keys = keys or self.s
        return {keys(): self.s() for _ in range(self.r.choice([0, 0, 1, 2, 5]))}

    def keep(self) -> dict[str, Any]:
        """Retention rules (unset half the time)."""
        r = self.r
        if r.random() < 0.5:
            return {}
        return {"keep_last": r.choice([0, 1, 3, 1_000_001, (1 << 32) - 1]),
                "keep_within_s": r.choice([0.0, 60.0, -1.0, 1e300, float("nan"), float("inf")])}

    def argv(self) -> list[str]:
        r = self.r
        if r.random() < 0.1:
            return r.choice([[], [""], ["\x00"]])
        prog = r.choice(["/nonexistent-memsnap-fuzz/" + self.s(), f"fz-{r.getrandbits(64):x}"])
        return [prog, *(self.s() for _ in range(r.choice([0, 1, 3])))]

    def request(self, pb: Any) -> tuple[str, Any]:
        from memsnap.v1 import peer_pb2 as peer_pb

        r = self.r
        self.plain = r.random() < 0.4
        rpc = r.choices(
            ["Status", "RunJob", "ListJobs", "Checkpoint", "Restore", "ListCheckpoints", "GetCheckpoint",
             "DeleteCheckpoint", "EvictCheckpoint", "WatchCheckpoint", "Migrate", "StopJob", "DeleteJob",
             "Prune", "JobLogs", "ResumeJob", "Peer.CommitMove", "Peer.RestoreReceived", "Peer.ReceiveImage",
             "Peer.PageTunnel", "Gc"],
            weights=[3, 3, 3, 14, 12, 5, 8, 8, 8, 6, 10, 6, 6, 2, 5, 5, 4, 12, 12, 6, 2])[0]
        if rpc == "Status":
            return rpc, pb.StatusRequest()
        if rpc == "StopJob":
            return rpc, pb.StopJobRequest(job=self.target(), kill=self.b(),
                                          timeout_s=r.choice([0.0, 0.1, -1.0, 1e300, float("nan"), 2.0]))
        if rpc == "DeleteJob":
            return rpc, pb.DeleteJobRequest(job=self.target(), force=self.b())
        if rpc == "Prune":
            return rpc, pb.PruneRequest(dry_run=self.b())
        if rpc == "Gc":
            return rpc, pb.GcRequest(dry_run=self.b())
        if rpc == "JobLogs":  # never follow: the stream would last as long as the job
            return rpc, pb.JobLogsRequest(job=self.target(), tail_bytes=r.choice([0, 1, 1 << 20, (1 << 64) - 1]))
        if rpc == "ResumeJob":
            return rpc, pb.ResumeJobRequest(job=self.target(),
                                            memory_limit_bytes=r.choice([0, 1, 1 << 30, (1 << 64) - 1]))
        if rpc == "Peer.CommitMove":
            return rpc, peer_pb.CommitMoveRequest(checkpoint_id=self.s())
        if rpc == "RunJob":
            env = self.smap(lambda: r.choice(["PATH", "LD_PRELOAD", "A=B", "", "X\x00", "HOME", self.s()]))
            return rpc, pb.RunJobRequest(argv=self.argv(), name=self.s(), cwd=r.choice(["", "/", self.s()]),
                                         env=env, **self.keep())
        if rpc == "ListJobs":
            return rpc, pb.ListJobsRequest()
        if rpc == "Checkpoint":
            return rpc, pb.CheckpointRequest(target=self.target(), stop=self.b(), tcp_established=self.b(),
                                             name=self.s(), wait=r.choice([0, 1, 2, 3, 99, -1]), **self.keep())
        if rpc == "Restore":
            return rpc, pb.RestoreRequest(checkpoint_id=self.s(), lazy=self.b(), gpu_map=self.smap(),
                                          tcp_established=self.b())
        if rpc == "ListCheckpoints":
            return rpc, pb.ListCheckpointsRequest(job=self.s())
        if rpc in ("GetCheckpoint", "DeleteCheckpoint", "EvictCheckpoint", "WatchCheckpoint"):
            return rpc, getattr(pb, rpc + "Request")(id=self.s())
        if rpc == "Migrate":
            return rpc, pb.MigrateRequest(target=self.target(), to=self.s(), via_store=self.b(), lazy=self.b(),
                                          move_ip=self.s(), tcp_established=self.b(),
                                          move_ip_dev_source=self.s(), move_ip_dev_target=self.s(),
                                          to_token=self.s(), plain_restore=self.b())
        if rpc == "Peer.ReceiveImage":
            chunks = [pb.ImageChunk(checkpoint_id=self.s("fz-" + str(r.getrandbits(32))), file=self.s(),
                                    offset=self.n(), data=r.randbytes(r.choice([0, 1, 256])),
                                    blake3=r.randbytes(r.choice([0, 32])), file_done=self.b(),
                                    manifest=r.choice([b"", b"{}", r.randbytes(64)]), expected_bytes=self.n())
                      for _ in range(r.choice([0, 1, 2, 3]))]
            return rpc, chunks
        if rpc == "Peer.RestoreReceived":
            req = pb.RestoreReceivedRequest(checkpoint_id=self.s(), lazy=self.b(), lazy_tunnel=self.s(),
                                            add_ip=self.s(), add_ip_dev=self.s(), tcp_established=self.b(),
                                            early_resume=self.b())
            if r.random() < 0.3:
                req.from_store.CopyFrom(pb.CheckpointInfo(id=self.s(), name=self.s(), owner_uid=r.choice(
                    [0, 65534, (1 << 32) - 1]), size_bytes=self.n()))
            return rpc, req
        # Peer.PageTunnel: only verdict queries and malformed openings (a real opening waits for lazy-pages).
        return rpc, [pb.TunnelChunk(tunnel_id=self.s(), data=r.randbytes(r.choice([0, 8])), done=True,
                                    ok=self.b(), error=self.s(), tag=r.randbytes(r.choice([0, 32])))
                     for _ in range(r.choice([0, 1, 2]))]


def fuzz(sock: str, seed: int, count: int, daemon_pid: int, uid: int | None) -> dict[str, Any]:
    """Sends count requests (as uid, when given) and returns the code counts and any bad answers."""
    import grpc

    from memsnap.v1 import memsnap_pb2 as pb
    from memsnap.v1 import memsnap_pb2_grpc as pb_grpc
    from memsnap.v1 import peer_pb2_grpc as peer_pb_grpc

    ch = grpc.insecure_channel(f"unix:{sock}", options=[("grpc.max_send_message_length", 64 << 20),
                                                         ("grpc.max_receive_message_length", 64 << 20)])
    stub = pb_grpc.MemsnapStub(ch)
    peer_stub = peer_pb_grpc.PeerStub(ch)
    if uid is not None:  # the channel connects lazily: the daemon sees this uid
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    gen = Gen(seed, daemon_pid)
    codes: Counter[str] = Counter()
    per_rpc: Counter[str] = Counter()
    bad: list[str] = []
    for i in range(count):
        rpc, req = gen.request(pb)
        per_rpc[rpc] += 1
        try:
            method = getattr(peer_stub, rpc[5:]) if rpc.startswith("Peer.") else getattr(stub, rpc)
            if rpc == "Peer.ReceiveImage":
                method(iter(req), timeout=10)
            elif rpc == "Peer.PageTunnel":
                list(method(iter(req), timeout=5))
            elif rpc in ("WatchCheckpoint", "JobLogs"):
                list(method(req, timeout=5))
            else:
                method(req, timeout=10)
            code = "OK"
            msg = ""
        except grpc.RpcError as e:
            code = e.code().name
            msg = e.details() or ""
        codes[code] += 1
        if code in BAD or len(msg) > 2048:
            bad.append(f"#{i} {rpc} -> {code}: {msg[:300]!r}; request: {str(req)[:300]!r}")
        if (i + 1) % BATCH == 0 or i + 1 == count:
            try:
                stub.Status(pb.StatusRequest(), timeout=10)
            except grpc.RpcError as e:
                bad.append(f"after request #{i}: Status did not answer: {e.code().name} {e.details()}")
                break
    ch.close()
    return {"codes": dict(codes), "per_rpc": dict(per_rpc), "bad": bad[:20], "n_bad": len(bad),
            "sent": sum(per_rpc.values())}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _decodes(cls: Any, data: bytes) -> bool:
    try:
        cls.FromString(data)
    except Exception:
        return False
    return True


def corrupt(r: random.Random, base: bytes, cls: Any) -> bytes:
    """Bytes that are no message of cls, made from a valid serialized one (base) in one of several ways."""
    field = r.randrange(1, 40)
    how = r.randrange(9)
    if how == 0:
        data = r.randbytes(r.randrange(1, 64))
    elif how == 1:  # a varint that never ends
        data = base + _varint(field << 3) + b"\x80" * r.randrange(1, 12)
    elif how == 2 and base:  # a tag's wire type changed
        i = 0
        data = bytearray(base)
        data[i] = (data[i] & ~7) | r.choice([3, 4, 5, 6, 7])
        data = bytes(data)
    elif how == 3:  # a length prefix far past the end (up to 2**64 - 1)
        data = base + _varint(field << 3 | 2) + _varint(r.choice([1 << 31, 1 << 32, (1 << 63) - 1, (1 << 64) - 1,
                                                                  r.randrange(100, 1 << 20)])) + b"xy"
    elif how == 4:  # groups nested deep, never closed
        data = b"\x0b" * r.choice([100, 10_000, 200_000])
    elif how == 5:  # a string that is not UTF-8
        data = base + _varint(1 << 3 | 2) + b"\x02\xff\xfe"
    elif how == 6 and base:  # cut short
        data = base[: r.randrange(len(base))]
    elif how == 7 and base:  # bytes flipped
        data = bytearray(base)
        for _ in range(r.randrange(1, 4)):
            data[r.randrange(len(data))] ^= r.randrange(1, 256)
        data = bytes(data)
    else:  # an end-group with no start
        data = base + _varint(field << 3 | 4)
    if _decodes(cls, data):  # (a corruption that still decodes would reach the engine: make it one that cannot)
        data += b"\x0f"  # field 1, wire type 7: no such wire type
    assert not _decodes(cls, data)
    return data


def _raw_methods() -> dict[str, tuple[str, Any, bool, bool]]:
    """rpc name (as Gen names them) -> (path, request class, client streaming, server streaming)."""
    from google.protobuf.message_factory import GetMessageClass
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    from memsnap.v1 import memsnap_pb2, peer_pb2

    out = {}
    for file, svc_name in ((memsnap_pb2, "Memsnap"), (peer_pb2, "Peer"), (health_pb2, "Health"),
                           (reflection_pb2, "ServerReflection")):
        svc = file.DESCRIPTOR.services_by_name[svc_name]
        for m in svc.methods:
            name = m.name if svc_name == "Memsnap" else f"{svc_name}.{m.name}"
            out[name] = (f"/{svc.full_name}/{m.name}", GetMessageClass(m.input_type), m.client_streaming,
                         m.server_streaming)
    return out


def fuzz_raw(sock: str, seed: int, count: int, daemon_pid: int, uid: int | None) -> dict[str, Any]:
    """Sends count requests whose bytes are no request message (as uid, when given) to every method, through a
    channel with no serializers; returns the codes seen and any answer that is not INVALID_ARGUMENT."""
    import grpc

    from memsnap.v1 import memsnap_pb2 as pb
    from memsnap.v1 import memsnap_pb2_grpc as pb_grpc

    ch = grpc.insecure_channel(f"unix:{sock}", options=[("grpc.max_send_message_length", 64 << 20)])
    stub = pb_grpc.MemsnapStub(ch)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    methods = _raw_methods()
    gen, r = Gen(seed, daemon_pid), random.Random(seed)
    codes: Counter[str] = Counter()
    per_rpc: Counter[str] = Counter()
    bad: list[str] = []
    extra = [n for n in methods if n.startswith(("Health.", "ServerReflection."))]
    for i in range(count):
        if i % 20 == 0:  # (health and reflection, a few times each)
            rpc, req = extra[(i // 20) % len(extra)], None
        else:
            rpc, req = gen.request(pb)
        path, cls, streaming_in, streaming_out = methods[rpc]
        base = (req[0] if req else cls()) if isinstance(req, list) else (cls() if req is None else req)
        payload = corrupt(r, base.SerializeToString(), cls)
        msgs = [payload] if not streaming_in or r.random() < 0.5 else [base.SerializeToString(), payload]
        per_rpc[rpc] += 1
        try:
            if streaming_in and streaming_out:
                list(ch.stream_stream(path)(iter(msgs), timeout=10))
            elif streaming_in:
                ch.stream_unary(path)(iter(msgs), timeout=10)
            elif streaming_out:
                list(ch.unary_stream(path)(payload, timeout=10))
            else:
                ch.unary_unary(path)(payload, timeout=10)
            code, msg = "OK", ""
        except grpc.RpcError as e:
            code, msg = e.code().name, e.details() or ""
        codes[code] += 1
        # A unary request is decoded before any servicer runs; a stream's messages as the servicer reads them,
        # so it may refuse the call before it reads the bad one (not root, no peer token, a bad first id...).
        must = not streaming_in
        if code in BAD or code == "DEADLINE_EXCEEDED" or (must and code != "INVALID_ARGUMENT") or len(msg) > 400 \
                or (must and not msg.startswith(f"the request is not a valid {cls.DESCRIPTOR.full_name} message")):
            bad.append(f"#{i} {rpc} -> {code}: {msg[:300]!r}; bytes: {payload[:80]!r}")
        if (i + 1) % BATCH == 0 or i + 1 == count:
            try:
                stub.Status(pb.StatusRequest(), timeout=10)
            except grpc.RpcError as e:
                bad.append(f"after raw request #{i}: Status did not answer: {e.code().name} {e.details()}")
                break
    ch.close()
    return {"codes": dict(codes), "per_rpc": dict(per_rpc), "bad": bad[:20], "n_bad": len(bad),
            "sent": sum(per_rpc.values())}


_WORKER = """
import json, sys
sys.path.insert(0, {repo!r})
import grpc, google.protobuf.descriptor_pb2, google.protobuf.message_factory, grpc_health.v1.health_pb2
import grpc_reflection.v1alpha.reflection_pb2
from tests.e2e.test_fuzz import {fn}
print(json.dumps({fn}({sock!r}, {seed}, {count}, {pid}, {uid})))
"""


@pytest.fixture
def fuzz_daemon(make_daemon) -> Iterator[DaemonProc]:
    """A daemon whose socket nobody reaches (0666 in a 0755 dir), with a store (adoption is fuzzed too)."""
    sockdir = Path(tempfile.mkdtemp(prefix="memsnap-fuzz-"))
    os.chmod(sockdir, 0o755)
    cfg = sockdir / "open.toml"
    cfg.write_text('[daemon]\nsocket_mode = "0666"\n')
    d = make_daemon("fuzz", extra=["--config", str(cfg)], socket_path=str(sockdir / "d.sock")).start()
    yield d
    shutil.rmtree(sockdir, ignore_errors=True)


def test_fuzzed_requests_as_root_and_nobody_get_no_internal_and_the_daemon_answers(fuzz_daemon):
    d = fuzz_daemon
    assert d.proc is not None
    results = {}
    for who, uid, seed in (("root", None, SEED), ("nobody", 65534, SEED + 1)):
        code = _WORKER.format(repo=str(REPO), sock=d.socket, seed=seed, count=PER_CALLER, pid=d.proc.pid,
                              uid=uid, fn="fuzz")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd="/",
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == 0, (who, r.stderr[-3000:])
        results[who] = json.loads(r.stdout.strip().splitlines()[-1])
        assert d.proc.poll() is None, f"memsnapd died while fuzzed as {who} (seed {seed}):\n{d.log.read_text()[-3000:]}"
    total = sum(res["sent"] for res in results.values())
    print(f"\nfuzz seed {SEED}: {total} requests")
    for who, res in results.items():
        print(f"  as {who}: {res['sent']} requests, codes {json.dumps(res['codes'], sort_keys=True)}")
        print(f"    per rpc {json.dumps(res['per_rpc'], sort_keys=True)}")
    assert total >= 2 * PER_CALLER
    for who, res in results.items():
        assert res["n_bad"] == 0, f"as {who} (seed {SEED}): " + "\n".join(res["bad"])
        assert not BAD & set(res["codes"])
        assert set(res["per_rpc"]) == _every_rpc(), res["per_rpc"]  # every RPC of both services was fuzzed
    with d.client() as c:
        assert c.status().version


def _every_rpc() -> set[str]:
    from memsnap.v1 import memsnap_pb2, peer_pb2

    return ({m.name for m in memsnap_pb2.DESCRIPTOR.services_by_name["Memsnap"].methods}
            | {"Peer." + m.name for m in peer_pb2.DESCRIPTOR.services_by_name["Peer"].methods})


def test_request_bytes_that_are_no_message_get_invalid_argument_from_every_method_as_root_and_nobody(fuzz_daemon):
    d = fuzz_daemon
    assert d.proc is not None
    results = {}
    for who, uid, seed in (("root", None, SEED + 2), ("nobody", 65534, SEED + 3)):
        code = _WORKER.format(repo=str(REPO), sock=d.socket, seed=seed, count=RAW_PER_CALLER, pid=d.proc.pid,
                              uid=uid, fn="fuzz_raw")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd="/",
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == 0, (who, r.stderr[-3000:])
        results[who] = json.loads(r.stdout.strip().splitlines()[-1])
        assert d.proc.poll() is None, f"memsnapd died under raw bytes as {who} (seed {seed}):\n" \
                                      f"{d.log.read_text()[-3000:]}"
    print(f"\nraw fuzz seed {SEED + 2}: {sum(res['sent'] for res in results.values())} requests")
    for who, res in results.items():
        print(f"  as {who}: {res['sent']} requests, codes {json.dumps(res['codes'], sort_keys=True)}")
    for who, res in results.items():
        assert res["n_bad"] == 0, f"as {who}: " + "\n".join(res["bad"])
        assert set(res["per_rpc"]) == set(_raw_methods()), res["per_rpc"]  # every method got raw bytes
    with d.client() as c:
        assert c.status().version
