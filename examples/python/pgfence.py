#!/usr/bin/env python3
"""A small pgfence client in Python: leases, fenced writes and leased job claims.

This is an example, not a package: copy what you need. It uses only the
standard library and psycopg 3 (Debian: apt-get install python3-psycopg), and
calls pgfence's door, the SECURITY DEFINER functions of schema pgfence that a
role with the grants of docs/migrations.md may execute. Every rule of a lease
or a claim is in those functions; this file only passes arguments and reads
results. Every call runs in autocommit mode (one statement, one transaction)
unless it says otherwise.

Two rules make it safe, in any language:

* A lease's key is a secret of its holder: 16 random bytes drawn per grant
  here (secrets.token_bytes). The database keeps only its SHA-256; renewing
  and releasing need the key, the token is public.
* Every write a lease protects is fenced: ``SET ..., fence = token WHERE key
  AND fence < token``. A holder paused past its lease (GC, swap, SIGSTOP)
  still believes it holds it; the fence refuses its late write because a newer
  holder wrote a larger token. Checking Lease.valid() first is not enough: the
  pause can fall between the check and the write.

The SQL sent here names every operator, type and function it relies on
outside pgfence by its pg_catalog name (OPERATOR(pg_catalog.=),
::pg_catalog.int8): an operator or type that a role could create in a schema
on the connection's search_path then cannot decide which row is written.
Table and column names are quoted identifiers, resolved as the caller wrote them.

The command line (python3 pgfence.py lease-worker|job-worker --help) drives
the cross-language tests of internal/testing/crosslang.
"""

import argparse
import json
import secrets
import sys
import time
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

KEY_BYTES = 16


class LeaseHeld(Exception):
    """The lease is held by someone else (held_by, expires_at on the database clock)."""

    def __init__(self, name, held_by, expires_at):
        super().__init__(f"lease {name!r} is held by {held_by!r} until {expires_at}")
        self.name, self.held_by, self.expires_at = name, held_by, expires_at


class LeaseLost(Exception):
    """The lease expired, was released or was granted to someone else: stop writing."""


class StaleToken(Exception):
    """A fenced write changed no row: a newer token wrote it (or the key does not exist)."""

    def __init__(self, table, key, token, fence):
        super().__init__(f"write to {table} key {key!r} refused: token {token}, row fence {fence}")
        self.table, self.key, self.token, self.fence = table, key, token, fence


class ChangedConcurrently(Exception):
    """A fenced write changed no row, yet the row's fence, read again, is below the token.

    The row changed between the UPDATE and the re-read (a concurrent
    transaction set its key, or inserted or re-created it): the reason of the
    refusal is unknown and nothing was written. Retryable: send the same write
    again with the same token (never a newer one); the next attempt gets a
    definite answer. Not a StaleToken. Go's fencedwrite reports this case as a
    retryable refusal without a Kind (SQLSTATE PF006 from pgfence.fence_refused).
    """

    def __init__(self, table, key, token, fence):
        super().__init__(f"write to {table} key {key!r} with token {token} not applied: the row changed "
                         f"concurrently (row fence now {fence}); send it again")
        self.table, self.key, self.token, self.fence = table, key, token, fence


class AlreadyApplied(StaleToken):
    """A fenced write changed no row because this token already wrote it (fence == token).

    The strict rule allows one write per row per grant; a StaleToken, so
    code that catches StaleToken still stops.
    """


@dataclass
class Lease:
    """A granted lease. token fences every write; key renews and releases it.

    deadline is local (time.monotonic()): the send time of the grant or
    renewal plus the TTL, never later than the database's expiry, so a lease
    ends here no later than in the database even if the clocks drift. It is
    -inf once release() was called, or renew() or release() raised
    LeaseLost: valid() is then False.
    """

    name: str
    holder: str
    token: int
    key: bytes = field(repr=False)
    ttl: float
    deadline: float
    expires_at: object  # database clock (datetime)

    def remaining(self):
        """Seconds left before the local deadline (negative when passed)."""
        return self.deadline - time.monotonic()

    def valid(self):
        """True while the local deadline has not passed."""
        return self.remaining() > 0


def _require_idle_autocommit(conn, what):
    # docs/sql.md rule 1: a lease function (and job_claim) times the lease
    # (claim) from now(), the start of its transaction, and makes its grant
    # durable at commit. In a transaction begun earlier the lease is older
    # than the send time, so the local deadline would fall after the
    # database's expiry, and the grant would not be durable until the caller
    # commits.
    if not conn.autocommit or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise ValueError(f"pgfence.{what} needs a connection in autocommit mode with no open transaction "
                         "(psycopg.connect(..., autocommit=True), outside 'with conn.transaction()')")


def _end(lease):
    # The lease is given back or lost: valid() is False from now on.
    lease.deadline = float("-inf")


def _deadline(sent, ttl, expires_at, db_now):
    # The database's expiry measured on its own clock, moved to ours from the
    # send time: the grant was made after we sent it, so this is never late.
    return sent + min(ttl, (expires_at - db_now).total_seconds())


def acquire(conn, name, ttl, holder):
    """Grant lease name to holder for ttl seconds if it is free or expired.

    Returns a Lease with a fresh 16-byte key; raises LeaseHeld if someone else
    holds it. conn must be in autocommit mode with no open transaction
    (ValueError otherwise), as for renew and release.
    """
    _require_idle_autocommit(conn, "acquire")
    key = secrets.token_bytes(KEY_BYTES)
    for _ in range(10):
        sent = time.monotonic()
        token, expires_at, held_by, db_now = conn.execute(
            "SELECT token, expires_at, held_by, db_now FROM pgfence.lock_grant("
            "%s::pg_catalog.text, %s::pg_catalog.text, %s::pg_catalog.int8, %s::pg_catalog.bytea)",
            (name, holder, int(ttl * 1e6), key),
        ).fetchone()
        if token is not None:
            return Lease(name, holder, token, key, ttl, _deadline(sent, ttl, expires_at, db_now), expires_at)
        if held_by is not None:
            raise LeaseHeld(name, held_by, expires_at)
        # All NULL: the lease changed under the call (released or expired): again.
    raise LeaseHeld(name, None, None)


def renew(conn, lease, ttl=None):
    """Extend the lease by ttl seconds (default: its TTL); raises LeaseLost.

    After LeaseLost the lease's deadline is -inf (valid() is False).
    """
    _require_idle_autocommit(conn, "renew")
    ttl = lease.ttl if ttl is None else ttl
    sent = time.monotonic()
    expires_at, db_now = conn.execute(
        "SELECT expires_at, db_now FROM pgfence.lock_renew("
        "%s::pg_catalog.text, %s::pg_catalog.int8, %s::pg_catalog.bytea, %s::pg_catalog.int8)",
        (lease.name, lease.token, lease.key, int(ttl * 1e6)),
    ).fetchone()
    if expires_at is None:
        _end(lease)
        raise LeaseLost(f"lease {lease.name!r} token {lease.token} is lost")
    lease.ttl, lease.expires_at = ttl, expires_at
    lease.deadline = _deadline(sent, ttl, expires_at, db_now)
    return lease


def release(conn, lease):
    """Give the lease back (the token stays in the row); raises LeaseLost.

    The lease's deadline is -inf once the call is sent (valid() is False),
    even if it then fails: the holder stops working under it. A connection
    that is not idle in autocommit is refused first (ValueError), and the
    lease is left as it was.
    """
    _require_idle_autocommit(conn, "release")
    _end(lease)
    (released,) = conn.execute(
        "SELECT released FROM pgfence.lock_release(%s::pg_catalog.text, %s::pg_catalog.int8, %s::pg_catalog.bytea)",
        (lease.name, lease.token, lease.key),
    ).fetchone()
    if not released:
        raise LeaseLost(f"lease {lease.name!r} token {lease.token} is lost")


def fenced_update(conn, table, key_column, key, values, token, fence_column="fence"):
    """UPDATE table SET values..., fence = token WHERE key_column = key AND fence < token.

    The strict fence rule: one write per row per grant, and none once a newer
    token wrote the row. When no row changed, the row's fence is read again:
    StaleToken when it is above the token (fence None: no such row),
    AlreadyApplied (a StaleToken) when this token wrote the row already, and
    ChangedConcurrently (not a StaleToken; send the write again with the same
    token) when it is below the token, the row having changed between the two
    statements. ValueError (nothing written) if key_column matched several
    rows. Identifiers are quoted; values, key and token are parameters,
    compared with pg_catalog's = and < (OPERATOR(pg_catalog.=)), never an
    operator found on the search_path.
    """
    tbl = sql.Identifier(*table.split("."))
    kc, fc = sql.Identifier(key_column), sql.Identifier(fence_column)
    sets = [sql.SQL("{} = %s").format(sql.Identifier(c)) for c in values]
    sets.append(sql.SQL("{} = %s::pg_catalog.int8").format(fc))
    stmt = sql.SQL("UPDATE {} SET {} WHERE {} OPERATOR(pg_catalog.=) %s"
                   " AND {} OPERATOR(pg_catalog.<) %s::pg_catalog.int8").format(
        tbl, sql.SQL(", ").join(sets), kc, fc)
    with conn.transaction():  # a refusal below rolls the UPDATE back
        cur = conn.execute(stmt, [*values.values(), token, key, token])
        if cur.rowcount > 1:
            raise ValueError(f"fenced_update: {cur.rowcount} rows of {table} have {key_column} = {key!r}: "
                             "key_column must be unique; nothing was written")
    if cur.rowcount == 1:
        return
    row = conn.execute(sql.SQL("SELECT {} FROM {} WHERE {} OPERATOR(pg_catalog.=) %s").format(fc, tbl, kc),
                       (key,)).fetchone()
    fence = row[0] if row else None
    if fence is not None and fence == token:
        raise AlreadyApplied(table, key, token, fence)
    if fence is not None and fence < token:
        raise ChangedConcurrently(table, key, token, fence)
    raise StaleToken(table, key, token, fence)


@dataclass
class Claim:
    """A leased claim of one job: complete or fail it with (id, token, key)."""

    id: int
    token: int
    key: bytes = field(repr=False)
    payload: object
    attempts: int
    # local, time.monotonic(): send time + TTL, never later than the
    # database's claim_expires_at (measured from its now())
    deadline: float


def enqueue(conn, queue, payloads):
    """Insert one job per payload (JSON-serialisable) into queue; returns their ids."""
    n = len(payloads)
    rows = conn.execute(
        "SELECT id FROM pgfence.job_enqueue(%s::pg_catalog.text[], %s::pg_catalog.jsonb[], %s::pg_catalog.int2[],"
        " %s::pg_catalog.timestamptz[], %s::pg_catalog.int4[])",
        ([queue] * n, [json.dumps(p) for p in payloads], [0] * n, [None] * n, [25] * n),
    ).fetchall()
    return [r[0] for r in rows]


def claim(conn, queue, holder, ttl, max_jobs):
    """Claim up to max_jobs jobs of queue for ttl seconds (database clock), with a fresh key.

    conn must be in autocommit mode with no open transaction (ValueError
    otherwise, nothing sent), as for acquire: job_claim times the claim from
    the start of its transaction (docs/sql.md rule 1), so in a transaction
    begun earlier the claim would end before Claim.deadline.
    """
    _require_idle_autocommit(conn, "claim")
    key = secrets.token_bytes(KEY_BYTES)
    ttl_ms = int(ttl * 1000)  # what the database is told; the deadline must not exceed it
    sent = time.monotonic()
    rows = conn.execute(
        "SELECT id, claim_token, payload, attempts, claim_expires_at, pg_catalog.now()"
        " FROM pgfence.job_claim(%s::pg_catalog.text, %s::pg_catalog.text, %s::pg_catalog.int8,"
        " %s::pg_catalog.int4, %s::pg_catalog.bytea)",
        (queue, holder, ttl_ms, max_jobs, key),
    ).fetchall()
    return [Claim(i, t, key, p, a, _deadline(sent, ttl_ms / 1000, exp, now)) for i, t, p, a, exp, now in rows]


def complete(conn, claims):
    """Complete the claims still held; returns the set of ids completed.

    A claim missing from the result was lost (expired and taken over): the
    completion changed nothing. To make a job's effect and its completion
    one, call this inside the transaction that wrote the effect, and roll
    back when the id is missing.
    """
    rows = conn.execute(
        "SELECT id FROM pgfence.job_complete(%s::pg_catalog.int8[], %s::pg_catalog.int8[], %s::pg_catalog.bytea[])",
        ([c.id for c in claims], [c.token for c in claims], [c.key for c in claims]),
    ).fetchall()
    return {r[0] for r in rows}


def fail(conn, c, error, retry_in=0.0, give_up=False):
    """Record a failed attempt: the job runs again after retry_in seconds (or goes dead).

    Returns False if the claim was lost (nothing changed).
    """
    row = conn.execute(
        "SELECT id FROM pgfence.job_fail(%s::pg_catalog.int8, %s::pg_catalog.int8, %s::pg_catalog.bytea,"
        " %s::pg_catalog.text, %s::pg_catalog.int8, %s::pg_catalog.bool)",
        (c.id, c.token, c.key, error, int(retry_in * 1000), give_up),
    ).fetchone()
    return row is not None


def _say(*words):
    print(*words, flush=True)


def lease_worker(args):
    """Take the lease (waiting while it is held), then obey commands from stdin.

    Commands, one per line: "write ID VALUE" (fenced_update of table's row
    ID), "raw ID VALUE" (the same without the fence condition, as a code path
    that forgot it would: the guard refuses it), "renew", "release", "exit".
    The worker writes whatever it is told, even past its local deadline, to
    show what the database refuses; an application checks lease.valid() first.
    Each result is one line: "ok ...", "refused ..." (a fenced write: "refused
    write ID stale|changed fence=F local-valid=B", changed for
    ChangedConcurrently).
    """
    conn = psycopg.connect(args.dsn, autocommit=True)
    stop = time.monotonic() + args.wait
    while True:
        try:
            lease = acquire(conn, args.name, args.ttl_ms / 1000, args.holder)
            break
        except LeaseHeld:
            if time.monotonic() > stop:
                raise
            time.sleep(0.02)
    _say("acquired", lease.token)
    for line in iter(sys.stdin.readline, ""):
        cmd = line.strip().split(maxsplit=2)
        if not cmd:
            continue
        op = cmd[0]
        try:
            if op == "write":
                fenced_update(conn, args.table, "id", int(cmd[1]), {"v": cmd[2]}, lease.token)
                _say("ok write", cmd[1], lease.token, "local-valid=%s" % lease.valid())
            elif op == "raw":
                conn.execute(sql.SQL("UPDATE {} SET v = %s, fence = %s::pg_catalog.int8"
                                     " WHERE id OPERATOR(pg_catalog.=) %s::pg_catalog.int8").format(
                    sql.Identifier(*args.table.split("."))), (cmd[2], lease.token, int(cmd[1])))
                _say("ok raw", cmd[1], lease.token)
            elif op == "renew":
                renew(conn, lease)
                _say("ok renew")
            elif op == "release":
                release(conn, lease)
                _say("ok release")
            elif op == "exit":
                break
            else:
                _say("error unknown command", op)
        except StaleToken as e:
            _say("refused", op, cmd[1], "stale", "fence=%s" % e.fence, "local-valid=%s" % lease.valid())
        except ChangedConcurrently as e:
            _say("refused", op, cmd[1], "changed", "fence=%s" % e.fence, "local-valid=%s" % lease.valid())
        except LeaseLost:
            _say("refused", op, "lost")
        except psycopg.Error as e:
            _say("refused", op, cmd[1] if len(cmd) > 1 else "-", e.sqlstate or "no-sqlstate")
    conn.close()


def job_worker(args):
    """Drain a queue: claim, record each job's effect and complete it in one transaction.

    The effect is a row (job_id, claim_token, who) in args.effects; it commits
    only if job_complete accepted the claim, so a stale worker's effect rolls
    back. A payload {"fail_once": true} fails its first attempt (job_fail,
    retried at once). With --hold N the N-th non-empty claim prints "held
    ID:TOKEN,..." and waits for a line on stdin before handling it (the test
    pauses the process there). Prints "done ID TOKEN", "stale ID TOKEN",
    "failed ID TOKEN", and "drained" when the queue has no available or
    running job left.
    """
    conn = psycopg.connect(args.dsn, autocommit=True)
    effects = sql.Identifier(*args.effects.split("."))
    claims_seen = 0
    while True:
        batch = claim(conn, args.queue, args.holder, args.ttl_ms / 1000, args.batch)
        if not batch:
            (left,) = conn.execute(
                "SELECT pg_catalog.count(*) FROM pgfence.jobs WHERE queue OPERATOR(pg_catalog.=) %s::pg_catalog.text"
                " AND state OPERATOR(pg_catalog.=) ANY ('{available,running}'::pg_catalog.text[])",
                (args.queue,)).fetchone()
            if left == 0:
                break
            time.sleep(0.02)  # poll: the jobs left are claimed by others or not due yet
            continue
        claims_seen += 1
        if claims_seen == args.hold:
            _say("held", ",".join(f"{c.id}:{c.token}" for c in batch))
            sys.stdin.readline()
        for c in batch:
            if isinstance(c.payload, dict) and c.payload.get("fail_once") and c.attempts == 1:
                _say("failed" if fail(conn, c, "first attempt fails") else "stale", c.id, c.token)
                continue
            done = False
            with conn.transaction():  # effect and completion commit together, or not at all
                conn.execute(sql.SQL("INSERT INTO {} (job_id, claim_token, who) VALUES (%s, %s, %s)")
                             .format(effects), (c.id, c.token, args.holder))
                if c.id not in complete(conn, [c]):
                    raise psycopg.Rollback()  # the claim was lost: undo the effect
                done = True
            _say("done" if done else "stale", c.id, c.token)
    _say("drained")
    conn.close()


def main(argv=None):
    """Command line: lease-worker and job-worker (see their docstrings)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    lw = sub.add_parser("lease-worker", help=lease_worker.__doc__.splitlines()[0])
    lw.add_argument("--dsn", required=True)
    lw.add_argument("--name", required=True)
    lw.add_argument("--holder", required=True)
    lw.add_argument("--ttl-ms", type=int, required=True)
    lw.add_argument("--table", required=True, help="fenced table with columns id, v, fence")
    lw.add_argument("--wait", type=float, default=60, help="seconds to wait for a held lease")
    jw = sub.add_parser("job-worker", help=job_worker.__doc__.splitlines()[0])
    jw.add_argument("--dsn", required=True)
    jw.add_argument("--queue", required=True)
    jw.add_argument("--holder", required=True)
    jw.add_argument("--ttl-ms", type=int, default=30000)
    jw.add_argument("--batch", type=int, default=5)
    jw.add_argument("--effects", required=True, help="table (job_id, claim_token, who)")
    jw.add_argument("--hold", type=int, default=0, help="wait for stdin before handling the N-th claim")
    args = p.parse_args(argv)
    {"lease-worker": lease_worker, "job-worker": job_worker}[args.cmd](args)


if __name__ == "__main__":
    main()
