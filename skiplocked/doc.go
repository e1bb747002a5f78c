// Package skiplocked claims rows with FOR UPDATE SKIP LOCKED, so that many
// workers share a batch without waiting for each other and no row is
// processed by two of them at once.
//
// It offers two kinds of claim.
//
// In-transaction claims ("the transaction is the lock"): [ClaimTx] locks up
// to limit jobs of pgfence.jobs inside the caller's transaction, and
// [CompleteTx] or [FailTx] finish them in it. The rows stay locked until the
// transaction ends; nothing is written to claim and nothing can be left
// behind. Use it when the work and the writes that record it fit in one
// transaction. On an application's own table the same claim is one
// SELECT ... FOR UPDATE SKIP LOCKED statement of the application's
// (docs/claims.md shows it).
//
// Leased claims, for longer work: [Claim] marks up to Limit jobs of
// pgfence.jobs as running, each with a new, larger claim token and a claim
// expiry on the database clock. [Complete], [Fail], [Renew] and [Release]
// (and their batch forms) are conditional on (job id, claim token): once an
// expired claim is re-claimed, the first worker's calls change nothing and
// return a [*ClaimLostError] ([ErrClaimLost]). They are idempotent: a retry
// under the same token whose claim already ended with that outcome succeeds.
// A job that fails max_attempts times goes to [StateDead]; failed attempts are
// retried after a backoff ([DefaultBackoff]).
//
// The claim expiry a worker sees is advisory. A job's effect commits exactly
// once when it is written in the same transaction as the completion
// ([NewTxWorker] does this); an effect committed before the completion, or
// outside the database, is at least once and needs an idempotency key or a
// fence.
//
// Jobs are inserted with [Enqueue] and [EnqueueMany]; an insert sends NOTIFY
// on [NotifyChannel] when it commits. A [Worker] runs a [TxHandler]
// ([NewTxWorker], exactly once) or a [Handler] ([NewWorker]) over a queue
// with a [Config]: concurrency, batch size, renewals, LISTEN/NOTIFY wake-ups
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
// [ErrConnection], ...) matched with errors.Is; database
// failures are [*DBError]. Bad input is refused before anything is sent to
// the database. [IsConnectionError] and [IsRetryable] classify the errors of
// the caller's own statements.
//
// docs/design.md in the repository explains the claim statements and the
// exactly-once argument.
package skiplocked
