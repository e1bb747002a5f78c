// Package pglock grants lease locks with fencing tokens on PostgreSQL, on the
// pgfence.locks table (see package migrations).
//
// A [Locker] grants [Lease]s. Every grant of a lock name increments the row's
// token in the same statement, so [Lease.Token] is larger than the token of
// every earlier grant of that name. Carry it into every write the lease
// protects and let the row refuse lower tokens:
//
//	lease, err := locker.Acquire(ctx, "invoice:42", 30*time.Second)
//	if err != nil { ... }
//	defer lease.Release(context.Background())
//	tag, err := pool.Exec(ctx,
//		`UPDATE invoices SET pdf = $2, fence = $3 WHERE id = $1 AND fence < $3`,
//		42, pdf, lease.Token())
//	if err == nil && tag.RowsAffected() == 0 { /* fenced out: a newer holder wrote */ }
//
// Package fencedwrite provides such writes ready-made; the package examples
// show a whole cycle.
//
// # Efficiency versus correctness
//
// A lease expires, so a holder that pauses past it (GC, VM stall, SIGSTOP)
// can wake up believing it still holds the lock while a second holder works.
// Every "am I still the holder?" answer of this package — [Lease.Done],
// [Lease.Err], [Lease.Deadline], [Elector.Lease], [Leader], [Inspect] — is
// therefore advisory. Used alone, a lease is an efficiency lock: duplicates
// stay possible. For correctness, fence every write with [Lease.Token]
// (package fencedwrite) or make the operation idempotent.
//
// # Leases
//
// Expiry is decided only by the database's clock. [Lease.Deadline] is the
// local deadline: the send time of the grant or renewal plus the TTL, on Go's
// monotonic clock; it never passes later than the database's expiry.
// [Lease.Done] and [Lease.Context] end when a renewal is refused, when the
// local deadline passes, on [Lease.Release] and on [Locker.Close];
// [Lease.Err] says which. Renew and Release are conditional on (name, holder,
// token): a stale holder's late call changes nothing and returns an error
// matching [pgfence.ErrLost]. Release keeps the row and its token. Grants and renewals
// are durable once acknowledged, whatever the server's synchronous_commit.
//
// Concurrent calls of one Locker share statements: while a grant (release)
// statement of a Locker is out, its further [Locker.TryAcquire], first
// [Locker.Acquire] attempts ([Lease.Release] calls) queue and go out together
// in one statement and one commit (at most 64 calls) when it returns; a call
// that finds none out is sent at once (while other calls of the Locker are
// in progress, with those that queued as it yielded the processor once).
// Each call gets its own lease or error, as with a statement of its own; a statement that fails on its connection fails every call it carried
// (their outcome is unknown).
//
// With [Config].KeepAlive one goroutine per Locker renews every lease before
// it expires, all the leases due in one statement per tick.
// A keep-alive proves the process can reach the database, not that the work
// progresses: fencing is still required, and renewing from the work loop
// ([Lease.Renew]) is better where possible.
//
// # Waiting
//
// [Locker.Acquire] waits without polling: a release wakes the waiters of that
// name through one LISTEN connection per pool, and a timer at the holder's
// expiry covers holders that crashed. [Config].PollOnly and
// [Config].PollInterval serve setups where LISTEN does not work (PgBouncer in
// transaction pooling mode). [Locker.TryAcquire] never waits.
// [Locker.AcquireMany] takes several names without deadlocks.
//
// [Locker.NewElector] returns an [Elector] for leader election on a lock
// name; the term's lease token fences the leader's writes.
//
// # Input and cancellation
//
// Names (1..512 bytes of UTF-8 without NUL), holders and TTLs
// ([MinTTL]..[MaxTTL]) are validated before any SQL runs
// ([pgfence.ErrInvalid]); names are always bind parameters and stored
// verbatim. Tokens never wrap: past the bigint maximum a grant fails with
// [pgfence.ErrTokenExhausted].
//
// Every method that does I/O takes a context first, and returns its error
// at once when it ends. Cancelling it abandons the round trip (pgx closes
// that connection). A grant whose outcome is therefore unknown stays held by
// this Locker's holder until its TTL passes ([Inspect] and [Locker.Adopt]
// reconcile it); so does one whose connection failed. The exception is a
// waiting Acquire's queueing statement (AcquireMany's and an Elector's
// too): once sent it is not cancelled, since a late one would queue the
// wait again after it left; it runs on, for at most 5 seconds more (or the
// TTL, if shorter) and until [Locker.Close] has waited for it, and then the
// wait leaves the queue and gives back a lease the statement granted or a
// release handed to it. A grant statement sent alone at once (a lone
// caller's: no other statement out, no call queued as it yielded) is
// cancelled: the goroutine a detached statement needs costs a
// lone caller more latency than coalescing may add. [Elector.Run] waits for
// its grant statements to answer when its context ends (for up to the lease
// duration) and gives back a grant that arrives then. A grant batched with
// others' goes on when all its callers gave up, and is given back; at
// [Locker.Close] it goes on only until Close has waited for it, as a
// queueing statement does. A lease's lifetime does not
// depend on the context passed to Acquire; use [Lease.Context] for the work.
//
// # Errors
//
// Every error is a [*pgfence.Error] (package github.com/pgfence/pgfence):
// Op names the call ("pglock.Acquire", "pglock.Renew", ...), Name the lock,
// Kind one of pgfence's sentinels and Err the cause. Ask with errors.Is:
// [pgfence.ErrLocked] (held by another holder: Holder and ExpiresAt say by
// whom and until when), [pgfence.ErrLost] (a renewal or release refused, or
// the local deadline passed: Holder and Token), [pgfence.ErrReleased],
// [pgfence.ErrClosed], [pgfence.ErrInvalid] (Reason names the argument),
// [pgfence.ErrSlowGrant], [pgfence.ErrTokenExhausted] and
// [pgfence.ErrNotFound] ([Leader]). A database or connection failure has no
// Kind and the driver's error as Err; [pgfence.IsRetryable] says whether to
// try again. [Elector.Run] alone returns its context's error as it is when
// the context ends.
//
// The reasons behind these choices (the clock, durability, wake-ups,
// overflow) are in docs/design.md in the repository.
package pglock
