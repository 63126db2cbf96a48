"""Busy TCP servers can be checkpointed: a connection still in a listener's accept queue (in flight) is left
out by default (--skip-in-flight) instead of failing the dump; --fail-on-in-flight keeps the strict way.

nginx runs with `user root`: on this VM root lacks CAP_SYS_RESOURCE, so CRIU cannot dump a process of another
uid (nginx's workers run as www-data by default; "Can't get rlimit").
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.helpers import DaemonProc, free_port, need, wait_for

_NEVER_ACCEPTS = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(sys.argv[1])))
    s.listen(16)
    print("listening", flush=True)
    while True:
        time.sleep(0.1)
""")


def _job(d: DaemonProc, jobs_to_kill: list[int], argv: list[str]) -> dict:
    job = json.loads(d.ctl("--json", "run", "--", *argv, check=True).stdout)
    jobs_to_kill.append(int(job["pid"]))
    return job


def test_a_connection_in_a_listeners_accept_queue_is_left_out_unless_asked_to_fail(daemon, jobs_to_kill):
    port = free_port()
    job = _job(daemon, jobs_to_kill, [sys.executable, "-c", _NEVER_ACCEPTS, str(port)])
    wait_for(lambda: "listening" in Path(job["log"]).read_text(), 20, what="the server to listen")
    client = socket.create_connection(("127.0.0.1", port), timeout=5)  # (the kernel completes the handshake)
    try:
        r = daemon.ctl("checkpoint", job["job"], "--fail-on-in-flight")
        assert r.returncode != 0 and "In-flight connection" in r.stderr and "--skip-in-flight" in r.stderr, \
            r.stderr
        ck = json.loads(daemon.ctl("--json", "checkpoint", job["job"], "--stop", check=True).stdout)
    finally:
        client.close()
    out = json.loads(daemon.ctl("--json", "restore", ck["id"], check=True).stdout)
    jobs_to_kill.append(int(out["pid"]))
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # the restored server listens again


def test_nginx_under_load_is_checkpointed_and_restored_with_its_connections(daemon, jobs_to_kill, tmp_path):
    need("nginx", "wrk", "ab", "curl")
    port = free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(textwrap.dedent(f"""
        user root;
        worker_processes 1;
        daemon off;
        error_log stderr warn;
        pid {tmp_path}/nginx.pid;
        events {{ worker_connections 256; }}
        http {{
          access_log off;
          client_body_temp_path {tmp_path}/body;
          proxy_temp_path {tmp_path}/proxy;
          fastcgi_temp_path {tmp_path}/fastcgi;
          uwsgi_temp_path {tmp_path}/uwsgi;
          scgi_temp_path {tmp_path}/scgi;
          server {{ listen 127.0.0.1:{port}; location / {{ return 200 "ok\\n"; }} }}
        }}
    """))
    job = _job(daemon, jobs_to_kill, [shutil.which("nginx") or "nginx", "-c", str(conf)])
    url = f"http://127.0.0.1:{port}/"
    wait_for(lambda: subprocess.run(["curl", "-sf", url], capture_output=True).returncode == 0, 20,
             what="nginx to answer")
    # wrk keeps 4 connections busy, and `ab` opens a new one per request: some are always in flight.
    load = [subprocess.Popen(["wrk", "-t1", "-c4", "-d60s", url], stdout=subprocess.DEVNULL),
            subprocess.Popen(["ab", "-q", "-c", "4", "-n", "10000000", url], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)]
    try:
        time.sleep(1)
        for _ in range(3):
            daemon.ctl("checkpoint", job["job"], "--tcp-established", check=True)
        ck = json.loads(daemon.ctl("--json", "checkpoint", job["job"], "--tcp-established", "--stop",
                                   check=True).stdout)
        out = json.loads(daemon.ctl("--json", "restore", "--tcp-established", ck["id"], check=True).stdout)
        jobs_to_kill.append(int(out["pid"]))
    finally:
        for p in load:
            p.kill()
            p.wait()
    assert subprocess.run(["curl", "-sf", url], capture_output=True, text=True).stdout == "ok\n"


_ECHO = textwrap.dedent("""
    import socket, sys, threading
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(sys.argv[1])))
    s.listen(16)
    print("listening", flush=True)
    def serve(c):
        while True:
            data = c.recv(1024)
            if not data:
                c.close()
                return
            c.sendall(data)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
""")


def test_a_server_with_connected_clients_checkpoints_without_tcp_established_and_its_clients_reconnect(
        daemon, jobs_to_kill):
    # Without --tcp-established CRIU refused every connected socket ("Connected TCP socket"); now their state is
    # left out (tcp_close) and the restored copy has them closed: a client sees its connection end and reconnects.
    port = free_port()
    job = _job(daemon, jobs_to_kill, [sys.executable, "-c", _ECHO, str(port)])
    wait_for(lambda: "listening" in Path(job["log"]).read_text(), 20, what="the server to listen")
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    client.sendall(b"ping")
    assert client.recv(16) == b"ping"
    daemon.ctl("checkpoint", job["job"], check=True)  # (it runs on, its client too)
    client.sendall(b"still")
    assert client.recv(16) == b"still"
    ck = json.loads(daemon.ctl("--json", "checkpoint", job["job"], "--stop", check=True).stdout)
    out = json.loads(daemon.ctl("--json", "restore", ck["id"], check=True).stdout)
    jobs_to_kill.append(int(out["pid"]))
    try:
        client.sendall(b"gone?")
        assert client.recv(16) == b""  # (closed by the stopped original, or reset)
    except OSError:
        pass
    client.close()
    again = socket.create_connection(("127.0.0.1", port), timeout=5)
    again.sendall(b"back")
    assert again.recv(16) == b"back"
    again.close()
