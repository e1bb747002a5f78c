// Package fencedwrite makes storage refuse writes from stale lock holders.
//
// A lease can expire while its holder is paused, so every "am I still the
// holder?" answer is advisory; correctness comes from the write itself. Each
// fenced row has a fence column (bigint) holding the highest fencing token it
// accepted, and every write carries the writer's token:
//
//	UPDATE t SET ..., fence = $token WHERE <key> AND fence < $token
//
// Zero rows changed means the writer was fenced out, and this package returns
// an error that says why ([Table.Update] reads the row in a second round trip
// only after a refusal; the other statements say why in the same one). Every
// error is a [*pgfence.Error] (Op the call, Name the table or key, Token the
// token refused); ask with errors.Is:
//
//   - [pgfence.ErrStaleToken]: a newer grant already wrote the row (Reason
//     "row fence F > token T"); stop, the lock is lost.
//   - [pgfence.ErrAlreadyApplied]: [Strict] mode only, this grant already
//     wrote the row (a replayed write is harmless).
//   - [pgfence.ErrNotFound]: no such row.
//   - no Kind, [pgfence.IsRetryable] true: refused, but the row changed
//     concurrently so the reason is unknown (rare; the write was not
//     applied, send it again). Its cause says "the row changed
//     concurrently".
//
// Bad input is [pgfence.ErrInvalid] naming the argument (a token <= 0, an
// invalid name, an unknown table or column), checked before any write runs;
// a database failure has no Kind and the driver's error as its cause.
//
// # Strict and re-entrant
//
// [Strict] (fence < token) accepts one write per row per grant. [Reentrant]
// (fence <= token) lets one grant write the same row again.
//
// # Three ways to write
//
//   - The fenced key/value table pgfence.fenced_values, shipped with the
//     migrations: [UpdateValue], [UpsertValue], [DeleteValue], [ReadValue],
//     [ModifyValue] (sqlc-generated queries, wrapped).
//   - Your own tables at run time: [Prepare] a [Spec] (table, key columns, set
//     columns), then [Table.Update], [Table.Upsert], [Table.Delete]. Names are
//     validated against the catalog and quoted with pgx.Identifier.
//   - Your own tables through sqlc: the command `pgfence gen fenced` writes a
//     migration that adds the fence column and a query file. Every generated
//     method fails closed: a refused write returns a non-nil error (SQLSTATE
//     PF003..PF007 raised by pgfence.fence_refused, with token, fence, table
//     and key), and
//     [TranslateError] maps it to the same errors ([pgfence.ErrStaleToken],
//     [pgfence.ErrAlreadyApplied], [pgfence.ErrNotFound], ...). Code that
//     checks only err never takes a refused write for a success.
//
// # Read-modify-write
//
// Fencing only the write of a read-modify-write still loses updates.
// [Table.Read] and [ReadValue] are fenced reads: they raise the row's fence to
// the token, so an older holder's later write is refused. [Table.Modify] and
// [ModifyValue] do the read and the write in one transaction under one check.
//
// # The guard
//
// [Guard] (SQL: pgfence.guard) attaches a trigger that makes the table refuse
// any UPDATE, INSERT or DELETE without the latest token of the row's lock,
// reported as [pgfence.ErrGuard] (or [pgfence.ErrStaleToken] for a
// superseded holder, [pgfence.ErrInvalid] for a token the lock never
// issued). [Unguard] detaches it;
// [ListGuarded] lists guarded tables. Roll out in this order: add the fence
// column (default 0), ship writers that send tokens, attach the guard last.
//
// docs/design.md in the repository explains the statements and the guard.
//
// # Connections and cancellation
//
// Every function takes a [pgfence.DBTX] (pool, connection or pgx.Tx) or a
// [Beginner]; ctx bounds the I/O. A cancelled context aborts the statement
// and pgx closes the connection; the write may or may not have been applied,
// and in strict mode repeating it with the same token tells ([pgfence.ErrAlreadyApplied]).
package fencedwrite
