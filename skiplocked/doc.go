// Package skiplocked claims rows with FOR UPDATE SKIP LOCKED, so that many
// workers share a batch without waiting for each other and no row is
// processed by two of them at once. Its jobs live in pgfence.jobs.
//
// # Which to pick
//
//   - The job's effect is written to the same database: run a [Worker] made
//     by [NewTxWorker]. Its [TxHandler] writes the effect through the
//     transaction the Worker opens, and the Worker completes the job in that
//     transaction: the effect commits exactly once.
//   - The effect is outside the database (an email, a call to another
//     service): a [Worker] made by [NewWorker] with a [Handler]. That is at
//     least once: make the effect idempotent, or fence it with the claim
//     token.
//   - A finite batch: [Enqueue] it, then [Worker.Drain] instead of
//     [Worker.Run]; it returns a [Summary] once the queue is empty.
//   - The work and its writes fit in one short transaction and you drive the
//     loop yourself: [ClaimTx], then [CompleteTx] or [FailTx], in your
//     transaction ("the transaction is the lock"). The rows stay locked until
//     the transaction ends; nothing is written to claim and nothing can be
//     left behind; a rollback gives the jobs back without counting an
//     attempt.
//   - Long work and you drive the loop yourself: leased claims. [Claim] marks
//     up to Limit jobs running, each with a new, larger claim token and an
//     expiry on the database clock; [Renew], [Complete], [Fail] and
//     [Release] take the claims' [ClaimRef]s ([Job.Ref]).
//   - Your own table, not pgfence.jobs: write one SELECT ... FOR UPDATE SKIP
//     LOCKED statement in your transaction; docs/claims.md in the repository
//     shows it.
//
// Leased claims are conditional on (job id, claim token, claim key): once an
// expired claim is re-claimed, the first worker's calls change nothing and
// return an error matching [pgfence.ErrLost] that says which claims were
// lost (see Errors below). They are
// idempotent: a retry under the same token whose claim already ended with
// that outcome succeeds. A job that fails MaxAttempts times goes to
// [StateDead]; failed attempts are retried after a backoff
// ([DefaultBackoff]).
//
// The claim expiry a worker sees is advisory. A job's effect commits exactly
// once when it is written in the same transaction as the completion; an
// effect committed before the completion, or outside the database, is at
// least once and needs an idempotency key or a fence.
//
// An insert by [Enqueue] wakes listening Workers with NOTIFY when it
// commits; Workers also poll (or only poll, for PgBouncer transaction
// pooling: [Config].PollOnly). [GetJob] reads one job, [QueueDepths] counts
// jobs per queue and state, [DeleteFinished] prunes finished ones.
//
// Cancellation: every function that does I/O takes ctx first. Cancelling
// it interrupts the statement in flight (pgx may close the connection to do
// so, which also ends a transaction and its in-transaction claims). Each
// statement is atomic: when a call returns a context error, its change
// either fully happened or did not happen at all; [GetJob] tells which.
//
// # Errors
//
// Every error is a [*pgfence.Error] (package github.com/pgfence/pgfence): Op
// names the call ("skiplocked.Complete", "skiplocked.Worker.Drain", ...),
// Name the queue where it is known, Kind one of pgfence's sentinels and Err
// the cause. Ask with errors.Is: [pgfence.ErrInvalid] (bad input or
// [Config], refused before anything is sent; Reason names the argument:
// "queue: empty", "ttl: ...", "Config.Concurrency: ..."),
// [pgfence.ErrLost] (a claim is not held any more: one error per lost ref,
// joined with errors.Join when a batch lost several; Token is the ref's
// token, Holder the job's holder now, Reason says what happened, as [Renew]
// describes), [pgfence.ErrNotFound] (no such job, or [Worker.Drain] of a
// queue with no job at all), [pgfence.ErrLocked] ([Renew] skipped a claim
// whose row was locked for a moment), [pgfence.ErrClosed] (the cause of a
// handler's context at shutdown) and [pgfence.ErrTokenExhausted]. A
// database or connection failure has no Kind and the driver's error as Err;
// [pgfence.IsRetryable] says whether to try again (Complete, Fail and
// Release are idempotent: call them again). [Worker.Drain] stopped before
// the queue was empty returns an error with no Kind whose Reason begins
// "not drained" and whose cause is its context's.
//
// docs/design.md in the repository explains the claim statements and the
// exactly-once argument.
package skiplocked
