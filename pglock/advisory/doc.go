// Package advisory takes PostgreSQL advisory locks for the cases that need no
// lease: "only one worker does X" where X either happens inside one
// transaction, or merely should not be done twice.
//
// # Two scopes, two guarantees
//
// [Xact] and [TryXact] begin a transaction, take a transaction-scoped lock
// (pg_advisory_xact_lock), run a function with the transaction, and commit,
// or roll back on an error or a panic. PostgreSQL releases the lock when the
// transaction ends, so it can never leak. When every write the lock protects
// is made in that transaction this is a correctness lock: the lock and the
// writes commit or vanish together, and a paused holder still holds the lock
// because its transaction is still open. It works through PgBouncer in
// transaction mode. [LockTx] and [TryLockTx] take the same lock inside a
// transaction the caller already has.
//
// [Acquire] and [TryAcquire] take a session-scoped lock (pg_advisory_lock) on
// a connection reserved from the pool until [SessionLock.Release]; the
// [SessionLock] closes [SessionLock.Done] when its connection dies. A session
// lock is an efficiency lock: writes made through other connections are not
// fenced. Use it to avoid duplicate work, never to protect data; for data use
// [Xact] or a lease with fenced writes (packages pglock and fencedwrite). A
// connection through a pooler is refused with [pgfence.ErrInvalid].
//
// docs/design.md in the repository explains the pooler checks and the key
// hash.
//
// # Keys
//
// A [Key] is either a bigint key ([Name], [Int64]) or a pair of ints
// ([Namespaced], [Pair]); PostgreSQL keeps the two spaces apart. [Name] hashes
// a name to 64 bits with a fixed definition, computable from psql (see
// [Name]). Every lock has a [Mode], [Exclusive] or [Shared].
//
// # Inspecting
//
// [List] returns the advisory locks of the current database with the backends
// holding or awaiting them ([LockInfo]), for operators and the CLI.
//
// # Errors
//
// Every error is a [*pgfence.Error] (package github.com/pgfence/pgfence):
// Op names the call ("advisory.TryAcquire", "advisory.Xact", ...), Name the
// key as pg_advisory_lock's arguments ("123", "7,-5"), Kind one of
// pgfence's sentinels and Err the cause. Ask with errors.Is:
// [pgfence.ErrInvalid] for bad input refused before any I/O (a key name, the
// zero Key, a Mode, a nil handle or function, a [SessionConfig] field; Reason
// names the argument: "key name: empty name"), and for a connection through
// a pooler in transaction mode (Reason says so and how to allow a pooler in
// session mode); [pgfence.ErrLocked] when another session holds the key
// (the Try variants, or lock_timeout: then Err is the server's error);
// [pgfence.ErrLost] for a session lock whose connection died or changed
// backend (Err is the cause) or that pg_advisory_unlock found not held (Err
// is nil); [pgfence.ErrReleased] after [SessionLock.Release] (but
// [SessionLock.Err] keeps ErrLost for a lock lost before). A database or connection failure has no Kind and
// the driver's error as Err; [pgfence.IsRetryable] says whether to try
// again. [Xact] returns fn's own error unchanged.
package advisory
