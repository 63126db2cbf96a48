#!/usr/bin/env python3
"""Test workload: an sqlite writer in rollback-journal mode (journal_mode=DELETE), one INSERT + COMMIT after
another, with --mib of random memory it checks now and then. Prints 'row N HOSTPID DIGEST' every --every rows,
so a move can be followed and the memory checked (the digest of the random memory never changes)."""
import argparse
import hashlib
import os
import sqlite3
import time

from jobpid import job_pid  # noqa: E402  (this folder is the script's sys.path[0])

p = argparse.ArgumentParser()
p.add_argument("--db", required=True)
p.add_argument("--mib", type=int, default=10)
p.add_argument("--every", type=int, default=50, help="print a line every this many rows")
p.add_argument("--sleep", type=float, default=0.0, help="seconds between commits")
p.add_argument("--in-txn", type=float, default=0.0, help="seconds of work inside each write transaction (its lock "
               "held meanwhile)")
a = p.parse_args()

mem = bytearray(os.urandom(a.mib << 20))
digest = hashlib.sha1(mem).hexdigest()[:16]
db = sqlite3.connect(a.db, isolation_level=None)
db.execute("PRAGMA journal_mode=DELETE")
db.execute("PRAGMA cache_size=-8192")
db.execute("CREATE TABLE IF NOT EXISTS t (n INTEGER PRIMARY KEY, v BLOB)")
print(f"start {job_pid()} {digest}", flush=True)
n = db.execute("SELECT COALESCE(MAX(n), 0) FROM t").fetchone()[0]
while True:
    n += 1
    db.execute("BEGIN")
    db.execute("INSERT INTO t (n, v) VALUES (?, ?)", (n, os.urandom(512)))
    if a.in_txn:
        time.sleep(a.in_txn)
    db.execute("COMMIT")
    if n % a.every == 0:
        d = hashlib.sha1(mem).hexdigest()[:16]
        print(f"row {n} {job_pid()} {d}", flush=True)
    if a.sleep:
        time.sleep(a.sleep)
