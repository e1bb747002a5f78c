// Package pglock grants lease locks with fencing tokens on PostgreSQL, on the
// pgfence.locks table (see package migrations).
//
// A [Locker] grants [Lease]s. Every grant of a lock name increments the row's
// token in the same statement, so [Lease.Token] is larger than the token of
// every earlier grant of that name. That token is what makes a lease safe:
//
//	lease, err := locker.Acquire(ctx, "invoice:42", 30*time.Second)
//	if err != nil { ... }
//	defer lease.Release(context.Background())
//	tag, err := pool.Exec(ctx,
//		`UPDATE invoices SET pdf = $2, fence = $3 WHERE id = $1 AND fence < $3`,
//		42, pdf, lease.Token())
//	if err == nil && tag.RowsAffected() == 0 { /* fenced out: a newer holder wrote */ }
//
// # Efficiency versus correctness
//
// A lease expires, because a crashed holder must not block everyone forever.
// So a holder that pauses (GC, VM stall, SIGSTOP, a slow disk) past its lease
// wakes up still believing it holds the lock, while a second holder already
// works. No check made by the client closes that window: the pause can fall
// right after the check. Therefore every "am I still the holder?" answer this
// package gives — [Lease.Done], [Lease.Err], [Lease.Deadline], [Elector.Lease],
// [Leader], [Inspect] — is advisory.
//
// Used alone, a lease is an efficiency lock: it avoids duplicate work most of
// the time, and duplicates remain possible. For correctness, the resource
// being written must refuse stale holders: carry [Lease.Token] into every
// write and let the row compare it with its fence column (package
// fencedwrite), or make the operation idempotent.
//
// # One clock
//
// Expiry is decided only by the database's clock. The grant is one statement
// (UPDATE ... SET token = token + 1 ... WHERE the lock is free or expired
// RETURNING token, expires_at; a name's first grant is an INSERT ... ON
// CONFLICT DO NOTHING) that compares and sets expiry with now(). Renewals and releases are conditional UPDATEs on (name, holder,
// token) that also require expires_at > now().
//
// now(), not clock_timestamp(), deliberately. Every statement of the package
// runs alone, so now() is the start of that statement's own transaction: one
// value for the whole statement, so the "is it expired?" test and the new
// expires_at use the same instant and expires_at - acquired_at is exactly the
// TTL. If the statement waits for a row lock (a concurrent release or
// renewal), now() stays at the start, which is earlier than the real time of
// the decision. That errs on the safe side in both places: an expiry is seen
// later, never earlier, than with clock_timestamp(), and the granted lease
// ends a little earlier, never later. clock_timestamp() would give the grant
// a few more microseconds of lease at the cost of two different instants in
// one decision.
//
// The client never decides who holds a lease; it may only stop earlier. The
// local deadline ([Lease.Deadline]) is the time the grant or renewal
// statement was sent plus the TTL, on Go's monotonic clock. The database's
// now() is later than the send time, so the client's deadline passes no later
// than the database's expiry, whatever the wall clocks say.
//
// # Lost leases
//
// [Lease.Done] and [Lease.Context] end when the database refuses a renewal
// (at once), when the local deadline passes, on [Lease.Release] and on
// [Locker.Close]; [Lease.Err] says which. Renew and Release are conditional on
// (name, holder, token): a stale holder's late call changes nothing and
// returns a [*LeaseLostError] (errors.Is(err, [ErrLeaseLost])). Release never
// deletes the row nor resets the token; it sets holder and expires_at to NULL
// and, when a waiter asked for it, NOTIFYs [NotifyChannel] with the lock name.
//
// # Keep-alive, and the renewer trap
//
// With [Config].KeepAlive a goroutine renews every lease at a fraction of its
// TTL (with jitter). A refused renewal ends the lease at once; connection
// errors are retried while the local deadline allows, then the lease ends.
//
// The trap: a renewer that keeps running while the worker is
// paused or stuck renews a lease nobody is using. Renewal success proves that
// the process can reach the database, not that the work is making progress,
// and a worker paused between its last check and its write still writes
// late. Keep-alive lengthens leases; it does not make them safe. Fencing is
// still required. Prefer renewing from the worker's own loop ([Lease.Renew]
// after each unit of work) when you can, so a stuck worker stops renewing.
//
// # Waiting
//
// [Locker.Acquire] waits without polling. Each Locker opens at most one
// dedicated LISTEN connection (outside the pool, with the pool's connection
// settings) that serves all its waiters: a release wakes the waiters of that
// name, and a timer at the current holder's expiry (plus jitter) covers
// holders that crashed without releasing. Before sleeping, a waiter marks
// the held row (column waiting_since), in the same statement that tries the
// grant and reads the holder's expiry, so a waiter that loses costs one
// round trip; a release sends NOTIFY only when the row was marked in the
// last 100 seconds: uncontended acquire/release cycles then never take
// PostgreSQL's cluster-wide NOTIFY commit lock. The mark and the release
// lock the same row, so either the release sees the mark or the waiter sees
// the release. Grants keep the mark, and waiters rewrite it only when it is
// over 30 seconds old, so a hot lock costs one mark write per 30 seconds;
// a waiter sleeps at most a minute before it tries (and marks) again, so a
// mark it relied on is always recent enough to make releases notify. A release
// wakes every waiter of the name; on a hot lock, a waiter that loses the
// race after a wake-up waits a short backoff (0.5 ms doubling to 16 ms)
// before it answers the next one, so N waiters do not each run a statement
// on every release. When the LISTEN connection fails,
// waiters keep their expiry timers and all of them retry once it is back, so
// a release made meanwhile is not missed. [Config].PollOnly and
// [Config].PollInterval serve setups where LISTEN does not work (a
// transaction-pooling PgBouncer).
//
// [Locker.AcquireMany] takes several names in sorted order, so callers with
// overlapping sets cannot deadlock, and releases what it took if it fails.
//
// # Durability
//
// The grant and renewal statements call set_config('synchronous_commit',
// 'on', true) inside themselves: the setting is local to the statement's
// implicit transaction and is read when that transaction commits, so an
// acknowledged token or expiry survives a server crash even when the server,
// database or role default is synchronous_commit = off, and no extra round
// trip is spent. A lost release only keeps the lock until its expiry, so
// releases use the session's setting.
//
// # Tokens
//
// Tokens start at 1 and grow by one per grant, across releases, expiries and
// restarts; rows are never deleted. At 9223372036854775807 the next grant
// fails with [ErrTokenOverflow] and changes nothing: tokens never wrap.
//
// # Leader election
//
// [Locker.NewElector] returns an [Elector] whose [Elector.Run] campaigns for a
// lock name: the leader renews every RetryPeriod and steps down when renewals
// have failed for RenewDeadline (before its LeaseDuration lets anyone else
// in); candidates wake on the leader's release or expiry. The term's lease,
// and so its fencing token, is passed to OnStartedLeading: fence the leader's
// writes with it. Cancelling Run's context resigns. [Leader] reports who
// leads, for observers.
//
// # Input and errors
//
// Names (1..[MaxNameBytes] bytes of UTF-8 without NUL), holders and TTLs
// ([MinTTL]..[MaxTTL]) are validated before any SQL runs ([InvalidError]);
// names are always bind parameters and stored verbatim. Database errors are
// returned as [*DBError] with the operation and name.
//
// # Cancellation
//
// Every method that does I/O takes a context first. Cancelling it abandons
// the round trip (pgx closes that connection): a grant or renewal whose
// outcome is unknown is safe — an unknown grant stays held by this Locker's
// holder until its TTL passes, an unknown renewal leaves the local deadline
// where it was. A lease's own lifetime does not depend on the context passed
// to Acquire; use [Lease.Context] for the work.
package pglock
