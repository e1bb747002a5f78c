// Package skiplocked claims rows with FOR UPDATE SKIP LOCKED, so that many
// workers share a batch without waiting for each other and no row is
// processed by two of them at once.
//
// It offers two kinds of claim.
//
// In-transaction claims ("the transaction is the lock"): [ClaimTx] with a
// [TxClaimer] built by [NewTxClaimer] from a [Spec] (table, key columns,
// filter, order, limit) locks up to Limit rows of an application's own table
// inside a transaction the caller controls, and [ClaimJobsTx] does the same on
// pgfence.jobs. The rows stay locked until the transaction commits or rolls
// back; a worker that dies loses its connection and PostgreSQL releases its
// rows at once. Nothing is written to claim, and nothing can be left behind.
// Use it when the work and the writes that record it fit in one transaction.
//
// Leased claims, for work that outlives one claim statement: [Claim] marks
// up to Limit jobs of pgfence.jobs as running in one statement, each with a
// new claim token (from a sequence that never cycles) and a claim expiry on
// the database clock. [Complete], [Fail], [Heartbeat] and [Release] (and
// their batch forms) are conditional on (job id, claim token). When a claim
// expires the job can be claimed again, under a larger token; from then on
// the first worker's calls change nothing and return a [*ClaimLostError]
// (matching [ErrClaimLost]). This is a fencing token per row: a stale worker
// cannot overwrite the outcome of the worker that holds the job now. A job
// that fails max_attempts times goes to [StateDead] with its last error
// kept; failed attempts are retried after a backoff ([DefaultBackoff]).
// Complete, Fail and Release are idempotent: repeating one whose claim
// already ended with that outcome under the same token (a retry after a lost
// reply) succeeds; only real losses are refused.
//
// As with every lease, the claim expiry a worker sees is advisory: a worker
// that pauses past it may already have lost the job. What pgfence guarantees
// is that its writes to pgfence.jobs are refused. The job's effect is safe
// when it is written in the same transaction as the completion: a refused
// completion rolls it back, so it commits exactly once ([NewTxWorker] does
// this for you, or call Complete on your own transaction). An effect
// committed before the completion is at least once: a worker paused between
// the two leaves it behind and the next worker does it again. Effects
// elsewhere (emails, other systems) need an idempotency key, or the claim
// token as a fence with package fencedwrite (which refuses a stale write only
// when the newer claim wrote first).
//
// Jobs are inserted with [Enqueue] and [EnqueueMany]; an insert sends NOTIFY
// on [NotifyChannel] when it commits. A [Worker] runs a [TxHandler]
// ([NewTxWorker], exactly once) or a [Handler] ([NewWorker]) over a queue
// with a [Config]: concurrency, batch size, heartbeats, LISTEN/NOTIFY wake-ups
// with a polling fallback (or polling only, for PgBouncer transaction
// pooling), graceful shutdown, and a hook for lost claims. [Worker.Run] runs
// until cancelled; [Worker.Drain] runs a finite batch until its queue is
// empty and returns a [Summary]. [QueueDepth] counts a queue's jobs per state.
//
// Cancellation: every function that does I/O takes ctx first. Cancelling
// it interrupts the statement in flight (pgx may close the connection to do
// so, which also ends a transaction and its in-transaction claims). Each
// statement is atomic: when a call returns a context error, its change
// either fully happened or did not happen at all; [GetJob] tells which.
//
// Errors are sentinels ([ErrInvalidQueue], [ErrInvalidLimit],
// [ErrUnknownColumn], [ErrConnection], ...) matched with errors.Is; bad
// input is refused before anything is sent to the database.
// [IsConnectionError] and [IsRetryable] classify the errors of the caller's
// own statements.
package skiplocked
