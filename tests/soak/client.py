"""A real program's client, run in the client's network namespace: python -m tests.soak.client KIND HOST PORT.

It keeps ONE connection and writes through it all the time (redis: SET w:N N; memcached: set w:N; http: GET
/), so an operation that keeps connections (--tcp-established) is seen from the client's side: the same
connection must go on without an error. Commands on stdin, one answer line each on stdout:

    pause      stop writing once the request in flight is answered     -> "paused ACKED"
    resume     write again, over the same connection (if it still works) -> "resumed"
    snapshot   read the server's whole state on a second connection     -> "snapshot STATE" (or "error WHY")
    stats      -> "stats REQUESTS ERRORS RECONNECTS P50_MS P99_MS MAX_GAP_MS FIRST_MS" since the last reset
                  (FIRST_MS: from the last resume to the first request answered after it)
    reset      -> "reset"
    quit

A failed request is retried on a new connection; each failure prints "error WHY" to stderr and counts.
"""

from __future__ import annotations

import hashlib
import socket
import sys
import threading
import time


class Conn:
    """One TCP connection with line/bulk reads."""

    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        got = self.sock.recv(1 << 16)
        if not got:
            raise ConnectionError("the server closed the connection")
        self.buf += got

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        out, _, self.buf = self.buf.partition(b"\r\n")
        return out

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def close(self) -> None:
        self.sock.close()


def _resp(conn: Conn) -> bytes | int | list[object] | None:
    """One RESP reply."""
    line = conn.line()
    kind, rest = line[:1], line[1:]
    if kind in (b"+",):
        return rest
    if kind == b"-":
        raise RuntimeError(rest.decode(errors="replace"))
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = conn.exact(n + 2)[:-2]
        return data
    if kind == b"*":
        return [_resp(conn) for _ in range(int(rest))]
    raise RuntimeError(f"bad reply {line[:40]!r}")


def redis_cmd(conn: Conn, *args: str) -> object:
    conn.send(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode()) for a in args))
    return _resp(conn)


class Program:
    """How to write one value and how to read the whole state, per kind."""

    def __init__(self, kind: str, host: str, port: int) -> None:
        self.kind, self.host, self.port = kind, host, port

    def connect(self) -> Conn:
        return Conn(self.host, self.port)

    def write(self, conn: Conn, n: int) -> None:
        if self.kind == "redis":
            if redis_cmd(conn, "SET", f"w:{n}", str(n)) != b"OK":
                raise RuntimeError("SET not OK")
        elif self.kind == "memcached":
            v = str(n).encode()
            conn.send(b"set w:%d 0 0 %d\r\n%s\r\n" % (n, len(v), v))
            if conn.line() != b"STORED":
                raise RuntimeError("not STORED")
        else:  # http: keep-alive GET
            conn.send(f"GET / HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
            status = conn.line()
            length = 0
            while (h := conn.line()) != b"":
                if h.lower().startswith(b"content-length:"):
                    length = int(h.split(b":", 1)[1])
            conn.exact(length)
            if b" 200 " not in status:
                raise RuntimeError(status.decode(errors="replace"))

    def snapshot(self, acked: int) -> str:
        conn = self.connect()
        try:
            if self.kind == "redis":
                size = redis_cmd(conn, "DBSIZE")
                digest = redis_cmd(conn, "DEBUG", "DIGEST")
                return f"dbsize={size} digest={digest.decode() if isinstance(digest, bytes) else digest}"
            if self.kind == "memcached":
                h = hashlib.sha1()
                found = 0
                for lo in range(1, acked + 1, 200):
                    keys = [f"w:{n}" for n in range(lo, min(acked, lo + 199) + 1)]
                    conn.send(("get " + " ".join(keys) + "\r\n").encode())
                    while (line := conn.line()) != b"END":
                        _, key, _, nbytes = line.split()
                        h.update(key + b"=" + conn.exact(int(nbytes) + 2)[:-2] + b";")
                        found += 1
                return f"items={found} digest={h.hexdigest()[:16]}"
            import http.client

            hc = http.client.HTTPConnection(self.host, self.port, timeout=10)
            hc.request("GET", "/data")
            r = hc.getresponse()
            data = r.read()
            hc.close()
            return f"status={r.status} data={hashlib.sha1(data).hexdigest()[:16]}"
        finally:
            conn.close()


def main() -> None:
    kind, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prog = Program(kind, host, port)
    lock = threading.Lock()
    state = {"paused": False, "acked": 0, "quit": False}
    paused = threading.Event()
    stats = {"requests": 0, "errors": 0, "reconnects": 0, "lat": [], "gap": 0.0, "last_ok": time.monotonic(),
             "resumed": 0.0, "first": 0.0}

    def writer() -> None:
        conn: Conn | None = None
        n = 0
        while not state["quit"]:
            with lock:
                if state["paused"]:
                    paused.set()
                    go = False
                else:
                    go = True
            if not go:
                time.sleep(0.01)
                continue
            try:
                if conn is None:
                    conn = prog.connect()
                    stats["reconnects"] += 1
                t0 = time.monotonic()
                nxt = state["acked"] + 1
                prog.write(conn, nxt)
                now = time.monotonic()
                with lock:
                    state["acked"] = nxt if kind != "http" else state["acked"]
                    stats["requests"] += 1
                    stats["lat"].append((now - t0) * 1000)
                    stats["gap"] = max(stats["gap"], now - stats["last_ok"])
                    stats["last_ok"] = now
                    if stats["resumed"] and not stats["first"]:
                        stats["first"] = now - stats["resumed"]
                n += 1
                time.sleep(0.005)
            except Exception as exc:  # any failure: count it, reconnect
                with lock:
                    stats["errors"] += 1
                print(f"error {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.1)

    threading.Thread(target=writer, daemon=True).start()
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "pause":
            paused.clear()
            with lock:
                state["paused"] = True
            paused.wait(30)
            print(f"paused {state['acked']}", flush=True)
        elif cmd == "resume":
            with lock:
                state["paused"] = False
                stats["last_ok"] = stats["resumed"] = time.monotonic()
                stats["first"] = 0.0
            print("resumed", flush=True)
        elif cmd == "snapshot":
            try:
                print(f"snapshot {prog.snapshot(state['acked'])}", flush=True)
            except Exception as exc:
                print(f"error {type(exc).__name__}: {exc}", flush=True)
        elif cmd == "stats":
            with lock:
                lat = sorted(stats["lat"]) or [0.0]
                out = (stats["requests"], stats["errors"], stats["reconnects"], lat[len(lat) // 2],
                       lat[min(len(lat) - 1, int(len(lat) * 0.99))], stats["gap"] * 1000, stats["first"] * 1000)
            print("stats {} {} {} {:.2f} {:.2f} {:.0f} {:.0f}".format(*out), flush=True)
        elif cmd == "reset":
            with lock:
                stats.update(requests=0, errors=0, reconnects=0, lat=[], gap=0.0)
            print("reset", flush=True)
        elif cmd == "quit":
            state["quit"] = True
            return


if __name__ == "__main__":
    main()
