// Package outbox sends side effects that cannot check a fencing token (an
// email, a payment, a call to another company's API) at most once per
// idempotency key, and never on behalf of a superseded lock holder.
//
// A fenced write protects a row: the storage refuses a token older than the
// row's fence. An email has no fence. So the holder does not send it; it
// records an intent with [Enqueue], in the same transaction as its fenced
// writes, and a [Dispatcher] sends it after the commit.
//
// [Enqueue] takes the holder's [pglock.Lease] and records the intent only if
// its token is the latest grant of its lock (the rule of the guard trigger of
// package fencedwrite) and the lease is held with its key: a holder that
// paused past its lease while another was granted the lock is refused with
// [pgfence.ErrStaleToken] (the kind of a refused fenced write), a released
// or expired lease with [pgfence.ErrLost], a token the lock never issued
// with [pgfence.ErrInvalid], and nothing is recorded. Tokens are public; the
// lease key is the holder's secret, so a session that read a token cannot
// record intents in the holder's name. The database checks the token again
// when the transaction commits, with the lock row locked until the commit
// ends, so no grant can slip in between.
//
// Each intent carries an idempotency key, unique per lock: a second intent
// of the lock with the same key is not recorded ([Result].Duplicate tells
// the caller, with the first intent's id and token).
//
// A [Dispatcher] delivers the intents of one topic to a [Handler] at least
// once, with the key and the attempt number ([Delivery]), using leased
// claims of package skiplocked: retries with backoff and jitter
// ([DefaultBackoff]), dead after the last attempt or at once on
// [Permanent], LISTEN/NOTIFY wake-ups with polling as a fallback, graceful
// shutdown and metrics through package observe. At least once means a
// handler may run twice for one intent (a dispatcher that dies after
// sending but before recording success); the receiving system deduplicates
// by key, and at-least-once delivery plus deduplication by key gives one
// effect. No delivery order is guaranteed. [NewHTTPHandler] is a Handler for
// HTTP receivers that follow the Idempotency-Key header convention.
//
// [Status] and the pgfence.outbox_status view count intents per topic:
// pending, waiting for a retry, in flight, delivered, dead.
//
// # Errors
//
// Every error is a [*pgfence.Error] (package github.com/pgfence/pgfence):
// Op names the call ("outbox.Enqueue", "outbox.NewDispatcher", ...), Name
// the lock (or the topic, the queue), Kind one of pgfence's sentinels and
// Err the cause. Ask with errors.Is: [pgfence.ErrStaleToken] (a newer grant
// exists; Token is the token refused, Reason gives the latest),
// [pgfence.ErrLost] (the lease is not held with its key: Holder, Token),
// [pgfence.ErrInvalid] (bad input, or a token the lock never issued; Reason
// names the argument: "Intent.Key: 0 bytes, want 1..255") and
// [pgfence.ErrNotFound] (a job of a dispatcher's queue with no intent; it
// is sent to dead). A database or connection failure has no Kind and the
// driver's error as Err; [pgfence.IsRetryable] says whether to try again
// (Enqueue retried with the same key records the intent at most once).
// [TranslateError] gives the same errors for the COMMIT of a transaction
// that enqueued. A [Handler]'s own errors, [*HTTPStatusError] among them, are
// delivery results, not pgfence errors.
package outbox
