package skiplocked

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/permanent"
	"github.com/pgfence/pgfence/internal/workerclaim"
)

// Handler processes one job. Return nil to complete it, an error to fail the
// attempt (retried after the backoff, dead when no attempts are left), or
// [Permanent](err) to send it to dead at once.
//
// ctx is cancelled with a cause matching [pgfence.ErrLost] when a renewal
// finds the claim lost (another worker now holds the job: stop, nothing this
// worker writes to pgfence.jobs will land) or when no renewal was answered
// before the claim's local deadline (it may have expired: another worker
// may claim the job; if the handler returns nil the Worker still completes
// it while the claim holds), or with a cause matching [pgfence.ErrClosed]
// when the worker's shutdown timeout passes. A handler that returns an
// error after a shutdown cancellation has its claim released, not failed.
//
// A Handler's effects outside pgfence.jobs are not fenced: after a pause past
// the claim, another worker may do them again. For effects in the same
// database, [TxHandler] makes effect and completion one transaction.
type Handler func(ctx context.Context, job Job) error

// TxHandler processes one job inside a transaction that the [Worker] opens
// and commits: do the job's effect through tx, and return nil. The Worker
// then completes the job in the same transaction, conditional on the claim
// token, and commits; if the claim was lost meanwhile it rolls back instead.
// So each job's effect commits exactly once, as long as every write of the
// effect goes through tx. Effects outside the database are not covered.
//
// Return an error to roll back and fail the attempt, or [Permanent](err) to
// send the job to dead at once. Never commit or roll back tx yourself (not
// even a habitual defer tx.Rollback): Commit and Rollback return an error and
// the attempt fails. Savepoints (tx.Begin) are fine. ctx is cancelled as for
// a [Handler]. The transaction holds a pooled connection: keep it short.
//
// tx is READ COMMITTED, whatever the database's or role's default isolation:
// the Worker renews the claim, which updates the job's row, while the
// handler runs, and under REPEATABLE READ or SERIALIZABLE the completion
// would then fail with a serialization error on every attempt that outlasts
// a renewal. Do not change the isolation level through tx (SET TRANSACTION).
type TxHandler func(ctx context.Context, tx pgx.Tx, job Job) error

// Permanent wraps err so that the [Worker] sends the job to dead at once
// instead of retrying it. Permanent(nil) is a permanent failure too, recorded
// as "permanent failure".
func Permanent(err error) error { return permanent.Wrap(err) }

// Summary counts what one [Worker] did, from the start of Run or Drain.
type Summary struct {
	// Claimed is the number of claims taken.
	Claimed int64
	// Completed is the number of jobs this worker completed (including
	// completions that had already landed, retried after a lost reply).
	Completed int64
	// Failed is the number of failed attempts that were written and left
	// the job available for a retry.
	Failed int64
	// Dead is the number of jobs this worker sent to dead (a failure on the
	// last attempt, or [Permanent]).
	Dead int64
	// Released is the number of claims given back unfinished (at shutdown).
	Released int64
	// ClaimsLost is the number of claims lost: another worker re-claimed the
	// job (or the claim ended otherwise) and this worker's outcome was
	// refused, or never sent because a renewal found the loss first. An
	// outcome whose reply was lost with the connection is sent again; it is
	// not a loss when the retry finds the job claimed again (after a release
	// or a failure) or deleted, less than ClaimTTL after the claim, or its
	// latest renewal, was sent (local clock): the claim could not have
	// expired yet, so the first attempt wrote the outcome, and it counts as
	// Completed, Failed, Dead or Released.
	ClaimsLost int64
	// Unknown is the number of outcomes that could not be written or
	// verified (the database was unreachable for longer than the retries).
	// Those claims expire and their jobs run again, unless a completion
	// landed unseen.
	Unknown int64
	// Drained is true when Drain returned because the queue had jobs and
	// none of them was available or running.
	Drained bool
	// Elapsed is the time Run or Drain took (zero while it runs).
	Elapsed time.Duration
}

type stats struct {
	claimed, completed, failed, dead, released, lost, unknown atomic.Int64
}

// Worker runs a [Handler] (or a [TxHandler]) over the jobs of one queue of
// pgfence.jobs with leased claims. Create it with [NewWorker] or
// [NewTxWorker] and start it with [Worker.Run] (until cancelled) or
// [Worker.Drain] (until the queue is empty).
type Worker struct {
	pool      *pgxpool.Pool
	queue     string
	handler   Handler
	txHandler TxHandler
	cfg       Config
	running   atomic.Bool
	stats     stats
	drained   atomic.Bool
	noJobs    atomic.Bool
	bg        context.Context // outcome writes: cancelled when Run returns
	hookCtx   context.Context // OnClaimLost's: ends ShutdownTimeout after Run's context does

	// claimRows runs the claim statement: nil for dbsqlc's ClaimJobs, or
	// the one a package built on the Worker gave it (package workerclaim).
	claimRows workerclaim.Func

	mu sync.Mutex
	// inflight holds the claims whose outcome is not written yet, by claim:
	// a job this worker claims again (its failure retried at once, or its
	// claim expired and taken back) while the outcome of its earlier claim
	// is still being written has an entry per claim, each renewed and
	// removed on its own.
	inflight map[ClaimRef]*held
	// outcomesHook, when set (tests), is called by an outcome writer after
	// it removed a batch's claims from inflight.
	outcomesHook func()
	lostMu       sync.Mutex // one OnClaimLost call at a time
}

func init() {
	workerclaim.Set = func(worker any, f workerclaim.Func) { worker.(*Worker).claimRows = f }
}

type held struct {
	ref ClaimRef
	job Job
	// deadline is the claim's local expiry: Go's monotonic clock read
	// before the claim statement (or the latest renewal that extended the
	// claim) was sent, plus its TTL, as for pglock's Lease.Deadline. The
	// database's expiry (statement_timestamp() + TTL, never moved earlier)
	// counts from a later instant, so until deadline the claim has not
	// expired on the database either, and nobody can have claimed the job
	// again (see landedUnseen). Guarded by Worker.mu.
	deadline time.Time
	cancel   context.CancelCauseFunc // nil until the handler starts
	lost     *claimInfo              // set when a renewal found the claim lost
	ended    bool                    // a renewal found the claim ended by its own outcome
	// answered is, like deadline, the send time + TTL of the latest
	// renewal statement that covered the claim and was answered, whether
	// it extended the claim or not (a row locked by the handler's own
	// transaction, which completed the job in it, is not extended).
	answered time.Time
	// expiry fires at deadline while the handler runs (see expire);
	// expired: it found deadline and answered passed and cancelled the
	// handler.
	expiry  *time.Timer
	expired bool
	// completing: the handler's transaction is completing the job; the row
	// is locked by it until it commits, so renewals leave it alone rather
	// than wait for that commit.
	completing bool
	started    bool
	returned   bool
}

type outcome int

const (
	outComplete  outcome = iota // complete the claim
	outCompleted                // completed in the handler's transaction
	outFail
	outRelease
	outLost
	outUnknown // the transaction's commit could not be verified
)

type result struct {
	h       *held
	outcome outcome
	err     error
	lost    *claimInfo
}

// NewWorker checks its arguments and returns a worker that runs h over the
// jobs of queue. It does no I/O. cfg may be nil.
//
// On a busy queue the worker overlaps up to three claim statements and two
// outcome statements when pool has the connections for them (MaxConns of 7
// or more: it leaves two for the renewals and the others' statements); with
// fewer it sends fewer at once, down to one of each with pgxpool's default
// of 4 on a small machine. The LISTEN connection is opened apart from pool,
// with its settings. A handler that uses pool itself competes with the
// renewals for its connections: size pool for both, or give the handlers a
// pool of their own. A claim whose renewal is not answered before its local
// deadline ends its handler's context (the job may then run elsewhere).
func NewWorker(pool *pgxpool.Pool, queue string, h Handler, cfg *Config) (*Worker, error) {
	if h == nil {
		return nil, invalid(opNewWorker, "h", "nil handler")
	}
	w, err := newWorker(pool, queue, cfg, false)
	if err != nil {
		return nil, err
	}
	w.handler = h
	return w, nil
}

// NewTxWorker checks its arguments and returns a worker that runs h over the
// jobs of queue, each in a transaction that also completes the job: see
// [TxHandler]. It does no I/O. cfg may be nil.
//
// Each handler in flight holds one connection of pool for its transaction,
// and renewals, claims and outcomes need more: pool's MaxConns must be at
// least Concurrency + 2. Concurrency defaults to min(4, MaxConns - 2).
func NewTxWorker(pool *pgxpool.Pool, queue string, h TxHandler, cfg *Config) (*Worker, error) {
	if h == nil {
		return nil, invalid(opNewTxWorker, "h", "nil handler")
	}
	w, err := newWorker(pool, queue, cfg, true)
	if err != nil {
		return nil, err
	}
	w.txHandler = h
	return w, nil
}

// Summary returns what the worker did so far: it may be called while Run or
// Drain runs, and after they returned.
func (w *Worker) Summary() Summary {
	return Summary{
		Claimed: w.stats.claimed.Load(), Completed: w.stats.completed.Load(), Failed: w.stats.failed.Load(),
		Dead: w.stats.dead.Load(), Released: w.stats.released.Load(), ClaimsLost: w.stats.lost.Load(),
		Unknown: w.stats.unknown.Load(), Drained: w.drained.Load() && !w.noJobs.Load(),
	}
}

// Holder returns the identity this worker writes into the holder column of
// the jobs it claims.
func (w *Worker) Holder() string { return w.cfg.Holder }

// Run claims and handles jobs until ctx is cancelled, then shuts down
// gracefully and returns nil:
//
//  1. it stops claiming and closes its listener connection;
//  2. claimed jobs whose handler has not started are released at once
//     (available again, attempt not counted);
//  3. handlers in flight keep running, their claims still renewed, for up
//     to [Config.ShutdownTimeout]; then their contexts are cancelled with
//     a cause matching [pgfence.ErrClosed]. A handler that then returns nil
//     is completed; one
//     that returns an error has its claim released.
//
// Run returns only after every handler has returned and its outcome has been
// written (or has failed to be written; the claim then expires). Handlers
// must honour their ctx. Run (or Drain) may be called once per Worker;
// [Worker.Summary] tells what it did.
//
// Claims are woken by NOTIFY on pgfence_jobs and by polling every
// [Config.PollInterval]. A handler's completion is written as soon as an
// outcome writer is free, never held back to fill a batch: it waits at most
// for the outcome statements already in flight (each bounded by
// [Config.ClaimTTL]), so the delay is about one statement's round trip
// while the database answers. A failed database call is logged and retried;
// an outcome that cannot be written leaves the claim to expire, so a job may
// run more than once, but a stale worker's outcome never overwrites a newer
// claim's.
func (w *Worker) Run(ctx context.Context) error {
	_, err := w.run(ctx, false)
	return err
}

// Drain is Run for a finite batch: it claims and handles jobs until the
// queue has no job left that is available (due or not) or running (other
// workers' claims included), then shuts down as Run does and returns its
// [Summary] with a nil error.
//
// Enqueue the whole batch before starting Drain ([Enqueue]): a job
// enqueued after the queue was found empty is left for the next run. Several
// workers may drain the same queue. A failed attempt with a long backoff
// keeps the drain waiting: set [Config.Backoff] for imports. Give each batch
// its own queue name to drain one batch among others.
//
// If ctx is cancelled before the queue is empty, Drain shuts down as Run does
// and returns the Summary so far with a [*pgfence.Error] that has no Kind,
// whose Reason begins "not drained" and whose cause (Err) is the context's
// cause, so errors.Is(err, context.Canceled) (or DeadlineExceeded) says why
// it stopped. If the queue has no job at all, in any state (a misspelt
// name), it returns an error matching [pgfence.ErrNotFound].
func (w *Worker) Drain(ctx context.Context) (Summary, error) {
	return w.run(ctx, true)
}

func (w *Worker) run(ctx context.Context, drain bool) (Summary, error) {
	op := opRun
	if drain {
		op = opDrain
	}
	if !w.running.CompareAndSwap(false, true) {
		return Summary{}, &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Name: w.queue, Reason: "Run or Drain called twice"}
	}
	start := time.Now()
	runCtx, stopRun := context.WithCancel(ctx) // also cancelled when drained
	defer stopRun()
	capacity := w.cfg.Concurrency + 2*w.cfg.BatchSize
	slots := make(chan struct{}, capacity)
	jobs := make(chan *held, capacity)
	results := make(chan result, capacity)
	wake := make(chan struct{}, 1)
	var stopping atomic.Bool

	jobBase, cancelJobs := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancelJobs(nil)
	bgCtx, stopBg := context.WithCancel(context.WithoutCancel(ctx))
	w.bg = bgCtx
	hookCtx, cancelHooks := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelHooks()
	w.hookCtx = hookCtx

	var bgWG, listenWG, fetchWG, handlerWG, completerWG sync.WaitGroup
	if !w.cfg.PollOnly {
		listenWG.Go(func() { w.listen(runCtx, wake) })
	}
	claimers, writers := w.pipelines(capacity)
	for i := range claimers {
		fetchWG.Go(func() { w.fetch(runCtx, i == 0, slots, jobs, wake, drain, stopRun) })
	}
	var respawn func()
	respawn = func() { // a handler's runtime.Goexit ended its goroutine (handle)
		handlerWG.Go(func() { w.handle(jobBase, jobs, results, slots, &stopping, respawn) })
	}
	for range w.cfg.Concurrency {
		handlerWG.Go(func() { w.handle(jobBase, jobs, results, slots, &stopping, respawn) })
	}
	for range writers {
		completerWG.Go(func() { w.complete(bgCtx, results, wake, drain) })
	}
	bgWG.Go(func() { w.renewLoop(bgCtx) })

	<-runCtx.Done()
	stopping.Store(true)
	// OnClaimLost's context ends ShutdownTimeout from here too, even when
	// the handlers are done before (an outcome writer may be in it).
	hookDeadline := time.AfterFunc(w.cfg.ShutdownTimeout, cancelHooks)
	defer hookDeadline.Stop()
	// ShutdownTimeout counts from here, not from the end of a claim
	// statement still out (which may take up to ClaimTTL to answer).
	deadline := time.AfterFunc(w.cfg.ShutdownTimeout, func() {
		cancelJobs(errShutdown)
		w.mu.Lock()
		for _, h := range w.inflight {
			if h.cancel != nil {
				h.cancel(errShutdown)
			}
		}
		w.mu.Unlock()
	})
	fetchWG.Wait()
	close(jobs) // the fetchers were the only senders
	// Release claimed jobs that no handler has started, without waiting for
	// a busy handler to take them (handlers release them too once stopping).
	handlerWG.Go(func() {
		for h := range jobs {
			results <- result{h: h, outcome: outRelease}
			<-slots
		}
	})
	listenWG.Wait()

	handlerWG.Wait()
	deadline.Stop()
	close(results)
	completerWG.Wait()
	stopBg()
	bgWG.Wait()

	sum := w.Summary()
	sum.Elapsed = time.Since(start)
	switch {
	case !drain:
		return sum, nil
	case w.noJobs.Load():
		return sum, &pgfence.Error{Op: op, Kind: pgfence.ErrNotFound, Name: w.queue,
			Reason: "the queue has no job in any state (never used, misspelt, or its finished jobs deleted)"}
	case !w.drained.Load():
		return sum, &pgfence.Error{Op: op, Name: w.queue, Reason: "not drained: stopped with available or running jobs left",
			Err: context.Cause(ctx)}
	}
	return sum, nil
}

// maxClaimers and maxWriters bound the claim and outcome statements one
// worker has in flight at once (see pipelines).
const (
	maxClaimers = 3
	maxWriters  = 2
)

// pipelines returns how many fetchers claim at once and how many goroutines
// write outcomes at once. One statement at a time leaves a worker bound by
// the round trip (and commit) of each statement rather than by the
// database's throughput, so a worker whose queue is busy overlaps up to
// maxClaimers claims and maxWriters outcome statements. Each claim reserves
// a whole batch of slots first, so the claims whose handler has not returned
// stay within capacity; the counts also stay within the pool, two of whose
// connections they leave to the renewals and other statements (the LISTEN
// connection is not the pool's).
func (w *Worker) pipelines(capacity int) (claimers, writers int) {
	conns := int(w.pool.Config().MaxConns) - 2
	if w.txHandler != nil {
		conns -= w.cfg.Concurrency // each handler's transaction holds one
	}
	writers = max(1, min(maxWriters, conns/2))
	claimers = max(1, min(maxClaimers, capacity/w.cfg.BatchSize, conns-writers))
	return claimers, writers
}

// fetch claims batches when there is room and work is likely, and hands the
// jobs to the handlers. Several fetchers run at once (see pipelines): each
// claims at start, the poller also every PollInterval; a fetcher that claimed
// a full batch claims again at once and wakes an idle one, so on a busy queue
// all of them claim, and on an idle queue one polls. In drain mode a fetcher
// ends the run (drained) when a claim finds nothing, nothing is in flight
// and the queue has no available or running job.
func (w *Worker) fetch(ctx context.Context, poller bool, slots chan struct{}, jobs chan<- *held, wake chan struct{}, drain bool, drained func()) {
	poll := time.NewTimer(0) // every fetcher claims once at start; only the poller polls
	defer poll.Stop()
	hungry := false
	for {
		if !hungry {
			select {
			case <-ctx.Done():
				return
			case <-wake:
			case <-poll.C:
			}
		}
		// Wait until a whole batch fits: the worker then never holds more
		// than Concurrency + 2*BatchSize claims whose handler has not
		// returned (a handler frees its slot when it hands its outcome over).
		n := w.cfg.BatchSize
		for i := range n {
			select {
			case slots <- struct{}{}:
			case <-ctx.Done():
				for range i {
					<-slots
				}
				return
			}
		}
		if ctx.Err() != nil {
			for range n {
				<-slots
			}
			return
		}
		// The claim statement is not cut when Run stops (or another
		// fetcher finds the queue drained): cut, it may still commit on
		// the server, and its jobs would stay claimed, an attempt counted,
		// until the claim expired. Let it answer (its result is useless
		// after ClaimTTL), and the jobs go the way of every claimed job
		// not started at shutdown: released at once.
		start := time.Now() // before the statement is sent: the claims' local deadline counts from it
		cctx, cancelClaim := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.ClaimTTL)
		claimed, err := claim(cctx, w.pool, ClaimParams{Queue: w.queue, Holder: w.cfg.Holder, Limit: n, TTL: w.cfg.ClaimTTL}, w.claimRows)
		cancelClaim()
		m := metricdefs.OrNop(w.cfg.Metrics)
		m.Observe(ctx, metricdefs.ClaimSeconds, time.Since(start).Seconds(), w.queue)
		if len(claimed) > 0 {
			m.Add(ctx, metricdefs.RowsClaimedTotal, float64(len(claimed)), w.queue)
			w.stats.claimed.Add(int64(len(claimed)))
		}
		if err != nil {
			w.cfg.Logger.Warn("skiplocked: claim failed", "queue", w.queue, "err", err)
		}
		for range n - len(claimed) {
			<-slots
		}
		hs := make([]held, len(claimed)) // one allocation for the batch
		deadline := start.Add(dbTTL(w.cfg.ClaimTTL))
		w.mu.Lock()
		for i, j := range claimed {
			hs[i] = held{ref: j.Ref(), job: j, deadline: deadline}
			w.inflight[hs[i].ref] = &hs[i]
		}
		idle := len(w.inflight) == 0
		w.mu.Unlock()
		for i := range hs {
			jobs <- &hs[i] // never blocks: capacity = slots
		}
		hungry = err == nil && len(claimed) == n
		if hungry {
			poke(wake) // more is likely: let an idle fetcher claim too
		}
		if !hungry && drain && err == nil && idle && w.isDrained(ctx) {
			drained()
			return
		}
		if !hungry && poller {
			poll.Reset(w.cfg.PollInterval)
		}
	}
}

// isDrained asks the database whether the queue has no available or running
// job, and records the answer. A failed check counts as "not drained".
func (w *Worker) isDrained(ctx context.Context) bool {
	unfinished, err := queueUnfinished(ctx, w.pool, w.queue)
	if err != nil {
		if ctx.Err() == nil {
			w.cfg.Logger.Warn("skiplocked: drain check failed", "queue", w.queue, "err", err)
		}
		return false
	}
	if unfinished {
		return false
	}
	if w.stats.claimed.Load() == 0 {
		found, err := queries.QueueHasJobs(ctx, w.pool, w.queue)
		if err != nil {
			if ctx.Err() == nil {
				w.cfg.Logger.Warn("skiplocked: drain check failed", "queue", w.queue, "err", err)
			}
			return false
		}
		w.noJobs.Store(!found)
	}
	w.drained.Store(true)
	return true
}
