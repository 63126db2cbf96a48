#!/usr/bin/env python3
"""Soak workload: an sqlite writer that commits row after row and prints 'committed N' once row N is durable in
the database file (journal_mode WAL or DELETE). Every row holds its own number and a checksum of it, so a reader
can check that rows 1..N are all there and intact. SIGUSR1 makes it allocate and touch as many MiB as
--grow-file says, once (the memory guard then parks it at its limit), and free them again.
"""
import argparse
import hashlib
import signal
import sqlite3
import time

p = argparse.ArgumentParser()
p.add_argument("--db", required=True)
p.add_argument("--journal", choices=["wal", "delete"], default="wal")
p.add_argument("--sleep", type=float, default=0.02)
p.add_argument("--grow-file", default="", help="SIGUSR1: allocate as many MiB as this file says")
a = p.parse_args()

grow = [False]
signal.signal(signal.SIGUSR1, lambda *_: grow.__setitem__(0, True))
db = sqlite3.connect(a.db, isolation_level=None, timeout=30)
db.execute(f"PRAGMA journal_mode={a.journal}")
db.execute("PRAGMA synchronous=FULL")
db.execute("CREATE TABLE IF NOT EXISTS t (n INTEGER PRIMARY KEY, sum TEXT NOT NULL)")
n = db.execute("SELECT COALESCE(MAX(n), 0) FROM t").fetchone()[0]
print(f"start {n} {a.journal}", flush=True)
while True:
    n += 1
    db.execute("BEGIN IMMEDIATE")
    db.execute("INSERT INTO t (n, sum) VALUES (?, ?)", (n, hashlib.sha1(str(n).encode()).hexdigest()))
    db.execute("COMMIT")
    print(f"committed {n}", flush=True)
    if grow[0]:
        grow[0] = False
        mib = int(open(a.grow_file).read())
        buf = bytearray(mib << 20)
        for off in range(0, len(buf), 4096):
            buf[off] = 1
        print(f"grew {mib}", flush=True)
        del buf
    time.sleep(a.sleep)
