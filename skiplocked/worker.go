package skiplocked

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/observe"
)

// Handler processes one job. Return nil to complete it, an error to fail the
// attempt (retried after the backoff, dead when no attempts are left), or
// [Permanent](err) to send it to dead at once.
//
// ctx is cancelled with cause [ErrClaimLost] when a heartbeat finds the claim
// lost (another worker now holds the job: stop, nothing this worker writes
// to pgfence.jobs will land), or with cause [ErrShutdown] when the worker's
// shutdown timeout passes. A handler that returns an error after a shutdown
// cancellation has its claim released, not failed.
//
// A Handler's effects outside pgfence.jobs are not fenced: a worker that
// pauses past its claim (GC, frozen VM) may have done its effect while
// another worker re-claims the job and does it again; only the stale
// completion is refused. For effects in the same database, [TxHandler] with
// [NewTxWorker] makes effect and completion one transaction (exactly once).
type Handler func(ctx context.Context, job Job) error

// TxHandler processes one job inside a transaction that the [Worker] opens
// and commits: do the job's effect through tx, and return nil. The Worker
// then completes the job in the same transaction, conditional on the claim
// token, and commits: the effect and the completion commit together or not at
// all. If the claim was lost meanwhile (the worker paused past its claim and
// another worker re-claimed the job), the completion changes nothing, the
// Worker rolls the transaction back and the stale effect never commits. So
// each job's effect commits exactly once, whatever pauses, kills and
// re-claims happen, as long as every write of the effect goes through tx.
//
// Return an error to roll back and fail the attempt (retried after the
// backoff, dead when no attempts are left), or [Permanent](err) to send the
// job to dead at once. Never commit or roll back tx yourself, not even with
// a habitual defer tx.Rollback(ctx): Commit and Rollback return an error,
// and the attempt fails and rolls back whatever the handler returns (a
// rollback cannot be told from a wish to abort). Nested transactions
// (tx.Begin, pgx.BeginFunc on tx: savepoints) are fine. ctx is cancelled as
// for a [Handler]; a cancelled statement aborts tx and the attempt fails.
//
// The transaction holds a pooled connection while the handler runs; keep it
// short (a file, a page of rows), and keep long work outside the database.
// Effects outside the database (an email, an HTTP call) are not covered:
// make them idempotent with a key, such as the job id.
type TxHandler func(ctx context.Context, tx pgx.Tx, job Job) error

// ErrShutdown is the cause of a handler's context cancellation when the
// [Worker] stops and [Config.ShutdownTimeout] has passed.
var ErrShutdown = errors.New("skiplocked: worker shutting down")

// Permanent wraps err so that the [Worker] sends the job to dead at once
// instead of retrying it.
func Permanent(err error) error { return &permanentError{err} }

type permanentError struct{ err error }

func (e *permanentError) Error() string { return "permanent: " + e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Config tunes a [Worker]. A nil *Config uses every default.
type Config struct {
	// Worker identifies this worker in claimed_by. Defaults to
	// "<hostname>/<pid>/<random hex>".
	Worker string
	// Concurrency is the number of jobs handled at once, 1..1000. Defaults to 4.
	Concurrency int
	// BatchSize is the most jobs one claim statement takes, 1..[MaxBatch].
	// The worker holds at most Concurrency + 2*BatchSize claims, so the next
	// batch is claimed while the current one is handled and the one before is
	// being completed. Defaults to Concurrency.
	BatchSize int
	// ClaimTTL is the length of a leased claim on the database clock,
	// [MinClaimTTL]..[MaxClaimTTL]. A claim of a worker that dies comes back
	// after at most ClaimTTL. Defaults to 30s.
	ClaimTTL time.Duration
	// HeartbeatInterval is how often the claims held are extended, in one
	// statement, by ClaimTTL. Must be shorter than ClaimTTL. Defaults to
	// ClaimTTL / 3.
	HeartbeatInterval time.Duration
	// PollInterval is how often the worker claims when no notification
	// arrives (the fallback when a NOTIFY is missed, and the only trigger in
	// PollOnly mode or for jobs whose run_at is in the future). At least 10ms.
	// Defaults to 1s.
	PollInterval time.Duration
	// PollOnly disables LISTEN, for PgBouncer in transaction pooling mode
	// where LISTEN does not work. Defaults to false: one dedicated
	// connection LISTENs on [NotifyChannel].
	PollOnly bool
	// Backoff gives the retry delay after a failed attempt (1-based).
	// Defaults to [DefaultBackoff].
	Backoff func(attempt int) time.Duration
	// ShutdownTimeout is how long handlers in flight may run after Run's
	// context is cancelled before their own contexts are cancelled (cause
	// [ErrShutdown]). Defaults to 10s.
	ShutdownTimeout time.Duration
	// Logger receives errors the loop recovers from (failed claims, lost
	// claims, listener reconnects). Defaults to discarding them.
	Logger *slog.Logger
	// Metrics receives rows claimed, completed, failed and dead, claims lost
	// and claim latency, labelled by queue (see package observe). Defaults to
	// nil: nothing is recorded. Claims lost counts real losses only: a
	// completion retried after a lost reply, or of a job the handler
	// completed itself, is a completion.
	Metrics observe.Metrics
	// OnClaimLost, when set, is called once for each claim this worker lost,
	// after the job's handler has returned: the outcome the worker tried to
	// write (completion, failure, release) was refused, or a heartbeat found
	// the job re-claimed and the handler's context was cancelled. err says
	// why, with the job's current token, state and holder, as [Complete]
	// reports it. Use it to compensate for an effect done outside the
	// database. It runs on the goroutine that writes outcomes (keep it short),
	// with a context cancelled when Run has returned; a panic in it is
	// recovered and logged.
	OnClaimLost func(ctx context.Context, job Job, err *ClaimLostError)
}

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
	// refused, or never sent because a heartbeat found the loss first.
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

	mu       sync.Mutex
	inflight map[int64]*held
}

type held struct {
	ref    ClaimRef
	job    Job
	cancel context.CancelCauseFunc // nil until the handler starts
	lost   *ClaimLostError         // set when a heartbeat found the claim lost
	ended  bool                    // a heartbeat found the claim ended by its own outcome
	// completing: the handler's transaction is completing the job; the row
	// is locked by it until it commits, so heartbeats leave it alone rather
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
	lost    *ClaimLostError
}

// NewWorker checks its arguments and returns a worker that runs h over the
// jobs of queue. It does no I/O. cfg may be nil.
func NewWorker(pool *pgxpool.Pool, queue string, h Handler, cfg *Config) (*Worker, error) {
	if h == nil {
		return nil, fmt.Errorf("%w: nil handler", ErrInvalidConfig)
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
// and heartbeats, claims and outcomes need more: pool's MaxConns must be at
// least Concurrency + 2. Concurrency defaults to min(4, MaxConns - 2).
func NewTxWorker(pool *pgxpool.Pool, queue string, h TxHandler, cfg *Config) (*Worker, error) {
	if h == nil {
		return nil, fmt.Errorf("%w: nil handler", ErrInvalidConfig)
	}
	w, err := newWorker(pool, queue, cfg, true)
	if err != nil {
		return nil, err
	}
	w.txHandler = h
	return w, nil
}

func newWorker(pool *pgxpool.Pool, queue string, cfg *Config, tx bool) (*Worker, error) {
	if nilcheck.IsNil(pool) {
		return nil, ErrNilDB
	}
	if err := checkQueue(queue); err != nil {
		return nil, err
	}
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	if c.Worker == "" {
		c.Worker = defaultWorkerID()
	}
	if err := checkWorker(c.Worker); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	maxConns := int(pool.Config().MaxConns)
	if c.Concurrency == 0 {
		c.Concurrency = 4
		if tx {
			c.Concurrency = max(1, min(4, maxConns-2))
		}
	}
	if c.Concurrency < 1 || c.Concurrency > 1000 {
		return nil, fmt.Errorf("%w: concurrency %d not in 1..1000", ErrInvalidConfig, c.Concurrency)
	}
	if tx && maxConns < c.Concurrency+2 {
		return nil, fmt.Errorf("%w: the pool has at most %d connections; a TxHandler worker with concurrency %d needs %d "+
			"(one per handler transaction, plus heartbeats, claims and outcomes): raise pool_max_conns or lower Concurrency",
			ErrInvalidConfig, maxConns, c.Concurrency, c.Concurrency+2)
	}
	if c.BatchSize == 0 {
		c.BatchSize = c.Concurrency
	}
	if err := checkLimit(c.BatchSize); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if c.ClaimTTL == 0 {
		c.ClaimTTL = 30 * time.Second
	}
	if err := checkTTL(c.ClaimTTL); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if c.HeartbeatInterval == 0 {
		c.HeartbeatInterval = c.ClaimTTL / 3
	}
	if c.HeartbeatInterval <= 0 || c.HeartbeatInterval >= c.ClaimTTL {
		return nil, fmt.Errorf("%w: heartbeat interval %s must be in (0, ClaimTTL %s)", ErrInvalidConfig, c.HeartbeatInterval, c.ClaimTTL)
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.PollInterval < 10*time.Millisecond {
		return nil, fmt.Errorf("%w: poll interval %s shorter than 10ms", ErrInvalidConfig, c.PollInterval)
	}
	if c.Backoff == nil {
		c.Backoff = DefaultBackoff
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = 10 * time.Second
	}
	if c.ShutdownTimeout < 0 {
		return nil, fmt.Errorf("%w: negative shutdown timeout %s", ErrInvalidConfig, c.ShutdownTimeout)
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return &Worker{pool: pool, queue: queue, cfg: c, inflight: map[int64]*held{}}, nil
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

// ID returns the worker identity stored in claimed_by.
func (w *Worker) ID() string { return w.cfg.Worker }

func defaultWorkerID() string {
	host, _ := os.Hostname()
	if host == "" {
		host = "unknown"
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// Run claims and handles jobs until ctx is cancelled, then shuts down
// gracefully and returns nil:
//
//  1. it stops claiming and closes its listener connection;
//  2. claimed jobs whose handler has not started are released at once
//     (available again, attempt not counted);
//  3. handlers in flight keep running, their claims still heartbeated, for up
//     to [Config.ShutdownTimeout]; then their contexts are cancelled with
//     cause [ErrShutdown]. A handler that then returns nil is completed; one
//     that returns an error has its claim released.
//
// Run returns only after every handler has returned and its outcome has been
// written (or has failed to be written; the claim then expires). Handlers
// must honour their ctx. Run (or Drain) may be called once per Worker;
// [Worker.Summary] tells what it did.
//
// Claims are woken by NOTIFY on [NotifyChannel] (one dedicated connection,
// reconnected on failure) and by polling every [Config.PollInterval]. A
// failed database call is logged and retried at the next poll; completions
// that cannot be written leave the claim to expire, so a job may run more
// than once but a stale worker's outcome never overwrites a newer claim's.
// Completions, failures and releases are idempotent, so the worker sends
// them again after a connection error without ever reporting its own landed
// outcome as a lost claim.
func (w *Worker) Run(ctx context.Context) error {
	_, err := w.run(ctx, false)
	return err
}

// Drain is Run for a finite batch: it claims and handles jobs until the
// queue has no job left that is available (due or scheduled for later, a
// failed attempt waiting for its retry included) or running (claims of other
// workers included: an expired one is taken over), then shuts down as Run
// does and returns its [Summary] with a nil error. Completed and dead jobs
// are finished; dead ones are counted in the Summary of the worker that sent
// them there and in [QueueDepth].
//
// Enqueue the whole batch before starting Drain (in one transaction, with
// [EnqueueMany]): a job enqueued after the queue was found empty is left
// for the next run. Several workers, in one process or many, may drain the
// same queue: each returns once the queue is empty, so killed or paused
// workers do not hold it up longer than their claims last. A failed attempt
// with a long backoff keeps the drain waiting: set [Config.Backoff] for
// imports. Give each batch its own queue name ("catalogue/2024-06-01") to
// drain one batch among others.
//
// If ctx is cancelled before the queue is empty, Drain shuts down as Run does
// and returns the Summary so far with an error matching [ErrNotDrained] and
// the context's cause. If the queue has no job at all, in any state (a
// misspelt name), it returns [ErrNoJobs]. Code that checks only err never
// takes an interrupted or mistaken drain for a finished one.
func (w *Worker) Drain(ctx context.Context) (Summary, error) {
	return w.run(ctx, true)
}

func (w *Worker) run(ctx context.Context, drain bool) (Summary, error) {
	if !w.running.CompareAndSwap(false, true) {
		return Summary{}, fmt.Errorf("%w: Run or Drain called twice", ErrInvalidConfig)
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

	var bgWG, listenWG, fetchWG, handlerWG, completerWG sync.WaitGroup
	if !w.cfg.PollOnly {
		listenWG.Go(func() { w.listen(runCtx, wake) })
	}
	fetchWG.Go(func() { w.fetch(runCtx, slots, jobs, wake, drain, stopRun) })
	for range w.cfg.Concurrency {
		handlerWG.Go(func() { w.handle(jobBase, jobs, results, &stopping) })
	}
	completerWG.Go(func() { w.complete(bgCtx, results, slots, wake, drain) })
	bgWG.Go(func() { w.heartbeat(bgCtx) })

	<-runCtx.Done()
	stopping.Store(true)
	fetchWG.Wait()
	close(jobs) // the fetcher was the only sender
	// Release claimed jobs that no handler has started, without waiting for
	// a busy handler to take them (handlers release them too once stopping).
	handlerWG.Go(func() {
		for h := range jobs {
			results <- result{h: h, outcome: outRelease}
		}
	})
	listenWG.Wait()

	handlersDone := make(chan struct{})
	go func() { handlerWG.Wait(); close(handlersDone) }()
	timer := time.NewTimer(w.cfg.ShutdownTimeout)
	select {
	case <-handlersDone:
	case <-timer.C:
		cancelJobs(ErrShutdown)
		w.mu.Lock()
		for _, h := range w.inflight {
			if h.cancel != nil {
				h.cancel(ErrShutdown)
			}
		}
		w.mu.Unlock()
		<-handlersDone
	}
	timer.Stop()
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
		return sum, fmt.Errorf("%w: %q (drain)", ErrNoJobs, w.queue)
	case !w.drained.Load():
		return sum, fmt.Errorf("%w: queue %q still has available or running jobs: %w", ErrNotDrained, w.queue, context.Cause(ctx))
	}
	return sum, nil
}

// fetch claims batches when there is room and work is likely, and hands the
// jobs to the handlers. In drain mode it ends the run (drained) when a claim
// finds nothing, nothing is in flight and the queue has no available or
// running job.
func (w *Worker) fetch(ctx context.Context, slots chan struct{}, jobs chan<- *held, wake <-chan struct{}, drain bool, drained func()) {
	poll := time.NewTimer(0) // claim once at start
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
		// than Concurrency + 2*BatchSize claims.
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
		start := time.Now()
		claimed, err := Claim(ctx, w.pool, ClaimParams{Queue: w.queue, Worker: w.cfg.Worker, Limit: n, TTL: w.cfg.ClaimTTL})
		m := observe.OrNop(w.cfg.Metrics)
		m.Observe(observe.ClaimSeconds, time.Since(start).Seconds(), w.queue)
		if len(claimed) > 0 {
			m.Add(observe.RowsClaimedTotal, float64(len(claimed)), w.queue)
			w.stats.claimed.Add(int64(len(claimed)))
		}
		if err != nil && ctx.Err() == nil {
			w.cfg.Logger.Warn("skiplocked: claim failed", "queue", w.queue, "err", err)
		}
		for range n - len(claimed) {
			<-slots
		}
		w.mu.Lock()
		hs := make([]*held, len(claimed))
		for i, j := range claimed {
			hs[i] = &held{ref: j.Ref(), job: j}
			w.inflight[j.ID] = hs[i]
		}
		idle := len(w.inflight) == 0
		w.mu.Unlock()
		for _, h := range hs {
			jobs <- h // never blocks: capacity = slots
		}
		hungry = err == nil && len(claimed) == n
		if !hungry && drain && err == nil && idle && w.isDrained(ctx) {
			drained()
			return
		}
		if !hungry {
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
				w.cfg.Logger.Warn("skiplocked: drain check failed", "queue", w.queue, "err", translate("drain check", err))
			}
			return false
		}
		w.noJobs.Store(!found)
	}
	w.drained.Store(true)
	return true
}

func (w *Worker) handle(base context.Context, jobs <-chan *held, results chan<- result, stopping *atomic.Bool) {
	for h := range jobs {
		w.mu.Lock()
		if stopping.Load() || h.lost != nil {
			lost := h.lost
			w.mu.Unlock()
			if lost != nil {
				results <- result{h: h, outcome: outLost, lost: lost}
			} else {
				results <- result{h: h, outcome: outRelease}
			}
			continue
		}
		jctx, cancel := context.WithCancelCause(base)
		h.cancel, h.started = cancel, true
		w.mu.Unlock()

		var r result
		if w.txHandler != nil {
			r = w.runTx(jctx, h)
		} else {
			r = decide(jctx, h, w.call(jctx, h.job))
		}
		cancel(nil)
		w.mu.Lock()
		h.returned = true
		w.mu.Unlock()
		results <- r
	}
}

// decide turns a handler's return and its context's cause into an outcome.
func decide(jctx context.Context, h *held, err error) result {
	cause := context.Cause(jctx)
	var lost *ClaimLostError
	switch {
	case errors.As(cause, &lost):
		return result{h: h, outcome: outLost, err: err, lost: lost}
	case err == nil:
		return result{h: h, outcome: outComplete}
	case errors.Is(cause, ErrShutdown):
		return result{h: h, outcome: outRelease, err: err}
	default:
		return result{h: h, outcome: outFail, err: err}
	}
}

// call calls the handler, turning a panic into an error.
func (w *Worker) call(ctx context.Context, j Job) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return w.handler(ctx, j)
}

// errHandlerTx is the error of Commit and Rollback on a TxHandler's tx.
var errHandlerTx = errors.New("skiplocked: a TxHandler must not commit or roll back its transaction: " +
	"the Worker commits it together with the job's completion (return an error to roll back)")

// handlerTx is the transaction a TxHandler gets: Commit and Rollback are
// refused (and remembered), everything else is the pgx.Tx.
type handlerTx struct {
	pgx.Tx
	misused atomic.Bool
}

// Commit refuses: the Worker commits.
func (t *handlerTx) Commit(context.Context) error { t.misused.Store(true); return errHandlerTx }

// Rollback refuses: the Worker rolls back when the handler returns an error.
func (t *handlerTx) Rollback(context.Context) error { t.misused.Store(true); return errHandlerTx }

// callTx calls the TxHandler, turning a panic into an error.
func (w *Worker) callTx(ctx context.Context, tx pgx.Tx, j Job) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return w.txHandler(ctx, tx, j)
}

// runTx runs a TxHandler: begin, handler, completion conditional on the
// claim token in the same transaction, commit. A refused completion rolls
// the effect back.
func (w *Worker) runTx(jctx context.Context, h *held) result {
	tx, err := w.pool.Begin(jctx)
	if err != nil {
		return decide(jctx, h, translate("begin the handler's transaction", err))
	}
	rollback := func() {
		rctx, cancel := context.WithTimeout(w.bg, 5*time.Second)
		defer cancel()
		_ = tx.Rollback(rctx) // on error pgx closes the connection: nothing commits
	}
	htx := &handlerTx{Tx: tx}
	herr := w.callTx(jctx, htx, h.job)
	if htx.misused.Load() && herr == nil {
		herr = errHandlerTx
	}
	if r := decide(jctx, h, herr); r.outcome != outComplete {
		rollback()
		return r
	}
	// The handler returned nil: complete the job in its transaction, with a
	// context the handler's cancellation does not end (a shutdown cancels
	// handlers, but a handler that returned nil is completed).
	cctx, cancel := context.WithTimeout(w.bg, w.cfg.ClaimTTL)
	defer cancel()
	if st := tx.Conn().PgConn().TxStatus(); st != 'T' {
		rollback()
		return result{h: h, outcome: outFail, err: fmt.Errorf("skiplocked: the handler's transaction is not open (status %q): "+
			"a statement failed, or COMMIT/ROLLBACK was sent through tx.Conn()", st)}
	}
	w.mu.Lock()
	h.completing = true
	w.mu.Unlock()
	done, err := queries.CompleteJobs(cctx, tx, []int64{h.ref.JobID}, []int64{h.ref.Token})
	if err != nil {
		rollback()
		return result{h: h, outcome: outFail, err: translate("complete in the handler's transaction", err)}
	}
	if len(done) == 0 {
		st := w.readClaim(h.ref)
		if st != nil && alreadyDone("complete", h.ref, st) {
			// Completed under this very claim by another call (the handler
			// called Complete itself): nobody else can run the job, so the
			// handler's effect commits.
			if err := tx.Commit(cctx); err != nil {
				w.cfg.Logger.Error("skiplocked: the handler completed its job itself, but its transaction did not commit",
					"job", h.ref.JobID, "token", h.ref.Token, "err", err)
				return result{h: h, outcome: outUnknown, err: err}
			}
			return result{h: h, outcome: outCompleted}
		}
		rollback()
		return result{h: h, outcome: outLost, lost: orBare(st, h.ref)}
	}
	cerr := tx.Commit(cctx)
	if cerr == nil {
		return result{h: h, outcome: outCompleted}
	}
	var pgErr *pgconn.PgError
	if errors.As(cerr, &pgErr) && !connectionSQLState(pgErr.Code) {
		// The server answered COMMIT with an error: it rolled back.
		return result{h: h, outcome: outFail, err: translate("commit", cerr)}
	}
	// The connection broke during COMMIT: read the row to learn whether it
	// committed. Only this transaction can complete the job under this token.
	st := w.readClaim(h.ref)
	switch {
	case st == nil:
		w.cfg.Logger.Error("skiplocked: commit outcome unknown; if it did not commit, the claim expires and the job runs again",
			"job", h.ref.JobID, "token", h.ref.Token, "err", cerr)
		return result{h: h, outcome: outUnknown, err: cerr}
	case alreadyDone("complete", h.ref, st):
		return result{h: h, outcome: outCompleted}
	case st.CurrentToken == h.ref.Token && st.State == StateRunning:
		return result{h: h, outcome: outFail, err: translate("commit", cerr)}
	default:
		return result{h: h, outcome: outLost, lost: st}
	}
}

// readClaim reads a job's claim columns for ref, retrying connection errors
// for up to ClaimTTL; nil when it cannot (or the job no longer exists).
func (w *Worker) readClaim(ref ClaimRef) *ClaimLostError {
	ctx, cancel := context.WithTimeout(w.bg, w.cfg.ClaimTTL)
	defer cancel()
	var st *ClaimLostError
	err := retryConn(ctx, func() (err error) {
		st, err = claimState(ctx, w.pool, "read claim", ref)
		return err
	})
	if err != nil {
		return nil
	}
	return st
}

func orBare(e *ClaimLostError, ref ClaimRef) *ClaimLostError {
	if e != nil {
		return e
	}
	return &ClaimLostError{JobID: ref.JobID, Token: ref.Token}
}

// complete writes outcomes, batching completions, and frees the slots.
func (w *Worker) complete(ctx context.Context, results <-chan result, slots <-chan struct{}, wake chan<- struct{}, drain bool) {
	const maxBatch = 1000
	m := observe.OrNop(w.cfg.Metrics)
	for first := range results {
		batch := []result{first}
	drain:
		for len(batch) < maxBatch {
			select {
			case r, ok := <-results:
				if !ok {
					break drain
				}
				batch = append(batch, r)
			default:
				break drain
			}
		}
		var done, release []result
		for _, r := range batch {
			switch r.outcome {
			case outComplete:
				done = append(done, r)
			case outCompleted:
				w.stats.completed.Add(1)
				m.Add(observe.RowsCompletedTotal, 1, w.queue)
			case outRelease:
				release = append(release, r)
			case outFail:
				w.fail(ctx, r)
			case outLost:
				w.reportLost(ctx, r.h, r.lost, "skiplocked: claim lost; outcome not written")
			case outUnknown:
				w.stats.unknown.Add(1)
			}
		}
		if len(done) > 0 {
			w.finish(ctx, "complete", done, CompleteMany)
		}
		if len(release) > 0 {
			w.finish(ctx, "release", release, ReleaseMany)
		}
		w.mu.Lock()
		for _, r := range batch {
			delete(w.inflight, r.h.ref.JobID)
		}
		idle := len(w.inflight) == 0
		w.mu.Unlock()
		for range batch {
			<-slots
		}
		if drain && idle {
			poke(wake) // the fetcher checks whether the queue is drained
		}
	}
}

// reportLost counts, logs and hands to OnClaimLost one lost claim.
func (w *Worker) reportLost(ctx context.Context, h *held, e *ClaimLostError, msg string) {
	e = orBare(e, h.ref)
	w.stats.lost.Add(1)
	observe.OrNop(w.cfg.Metrics).Add(observe.ClaimsLostTotal, 1, w.queue)
	w.cfg.Logger.Warn(msg, "job", e.JobID, "token", e.Token, "current_token", e.CurrentToken,
		"state", string(e.State), "claimed_by", e.ClaimedBy)
	if w.cfg.OnClaimLost == nil {
		return
	}
	defer func() {
		if r := recover(); r != nil {
			w.cfg.Logger.Error("skiplocked: OnClaimLost panicked", "job", e.JobID, "panic", fmt.Sprint(r))
		}
	}()
	w.cfg.OnClaimLost(ctx, h.job, e)
}

// connRetries is how many times the worker sends a completion, failure,
// release or heartbeat again after a connection error (the pool may hand
// out a connection whose backend was ended since its last use).
const connRetries = 3

// retryConn runs op, and runs it again up to connRetries times while it fails
// with ErrConnection and ctx allows. Every statement it retries is
// conditional on the claim tokens, so a retry never changes a job the worker
// no longer holds, and idempotent: if a first attempt did commit before its
// connection failed, the retry reports success, not a lost claim.
func retryConn(ctx context.Context, op func() error) error {
	err := op()
	for i := 1; i <= connRetries && errors.Is(err, ErrConnection) && ctx.Err() == nil; i++ {
		t := time.NewTimer(time.Duration(i) * 10 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
		err = op()
	}
	return err
}

func (w *Worker) finish(ctx context.Context, op string, rs []result, f func(context.Context, DB, []ClaimRef) ([]ClaimRef, error)) {
	cctx, cancel := context.WithTimeout(ctx, w.cfg.ClaimTTL)
	defer cancel()
	refs := make([]ClaimRef, len(rs))
	for i, r := range rs {
		refs[i] = r.h.ref
	}
	err := retryConn(cctx, func() (err error) {
		_, err = f(cctx, w.pool, refs)
		return err
	})
	lost := map[ClaimRef]*ClaimLostError{}
	if cl := (*ClaimsLostError)(nil); errors.As(err, &cl) {
		err = nil // counted and logged per claim below
		for i, r := range cl.Lost {
			lost[r] = orBare(cl.Details[i], r)
		}
	}
	if err != nil {
		w.stats.unknown.Add(int64(len(rs)))
		w.cfg.Logger.Error("skiplocked: "+op+" failed; claims will expire", "jobs", len(refs), "err", err)
		return
	}
	landed := 0
	for _, r := range rs {
		if e, ok := lost[r.h.ref]; ok {
			w.reportLost(ctx, r.h, e, "skiplocked: "+op+" refused: claim lost")
			continue
		}
		landed++
	}
	if op == "complete" {
		w.stats.completed.Add(int64(landed))
		if landed > 0 {
			observe.OrNop(w.cfg.Metrics).Add(observe.RowsCompletedTotal, float64(landed), w.queue)
		}
	} else {
		w.stats.released.Add(int64(landed))
	}
}

func (w *Worker) fail(ctx context.Context, r result) {
	cctx, cancel := context.WithTimeout(ctx, w.cfg.ClaimTTL)
	defer cancel()
	var perm *permanentError
	msg := "error"
	if r.err != nil {
		msg = r.err.Error()
	}
	var job Job
	err := retryConn(cctx, func() (err error) {
		job, err = Fail(cctx, w.pool, r.h.ref, FailParams{
			Error:   msg,
			RetryIn: min(max(w.cfg.Backoff(r.h.job.Attempts), 0), MaxRetryDelay),
			GiveUp:  errors.As(r.err, &perm),
		})
		return err
	})
	m := observe.OrNop(w.cfg.Metrics)
	var lost *ClaimLostError
	switch {
	case err == nil:
		m.Add(observe.RowsFailedTotal, 1, w.queue)
		if job.State == StateDead {
			w.stats.dead.Add(1)
			m.Add(observe.RowsDeadTotal, 1, w.queue)
		} else {
			w.stats.failed.Add(1)
		}
	case errors.As(err, &lost) && lost.CurrentToken == r.h.ref.Token && lost.Outcome == OutcomeCompleted:
		// A commit whose reply was lost did land after all (see runTx).
		w.stats.completed.Add(1)
		m.Add(observe.RowsCompletedTotal, 1, w.queue)
	case lost != nil:
		w.reportLost(ctx, r.h, lost, "skiplocked: fail refused: claim lost")
	case errors.Is(err, ErrJobNotFound):
		w.reportLost(ctx, r.h, nil, "skiplocked: fail refused: job deleted")
	default:
		w.stats.unknown.Add(1)
		w.cfg.Logger.Warn("skiplocked: fail not written", "job", r.h.ref.JobID, "err", err)
	}
}

// heartbeat extends every claim held, and cancels handlers whose claim is
// lost. A claim found ended by its own outcome under the same token (the
// handler completed it, or the completion raced the heartbeat) is not a
// loss: it is only no longer heartbeated.
func (w *Worker) heartbeat(ctx context.Context) {
	t := time.NewTicker(w.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		w.mu.Lock()
		refs := make([]ClaimRef, 0, len(w.inflight))
		for _, h := range w.inflight {
			if h.lost == nil && !h.ended && !h.completing {
				refs = append(refs, h.ref)
			}
		}
		w.mu.Unlock()
		for len(refs) > 0 {
			chunk := refs[:min(len(refs), MaxBatch)]
			refs = refs[len(chunk):]
			hctx, cancel := context.WithTimeout(ctx, w.cfg.ClaimTTL) // a later heartbeat is useless
			var lost []ClaimRef
			err := retryConn(hctx, func() (err error) {
				_, lost, err = HeartbeatMany(hctx, w.pool, chunk, w.cfg.ClaimTTL)
				return err
			})
			cancel()
			var details []*ClaimLostError
			if cl := (*ClaimsLostError)(nil); errors.As(err, &cl) {
				err, details = nil, cl.Details // the lost claims are cancelled below
			}
			if err != nil {
				w.cfg.Logger.Warn("skiplocked: heartbeat failed", "claims", len(chunk), "err", err)
				continue
			}
			w.mu.Lock()
			for i, r := range lost {
				h, ok := w.inflight[r.JobID]
				if !ok || h.ref != r {
					continue
				}
				d := details[i]
				if d != nil && d.CurrentToken == r.Token && (d.Outcome == OutcomeCompleted || d.Outcome == OutcomeFailed || d.Outcome == OutcomeReleased) {
					h.ended = true
					continue
				}
				h.lost = orBare(d, r)
				if h.cancel != nil && !h.returned {
					h.cancel(h.lost)
				}
			}
			w.mu.Unlock()
		}
	}
}

// listen holds one connection LISTENing on NotifyChannel and wakes the
// fetcher when a notification names this worker's queue. It reconnects after
// failures, waking the fetcher each time since notifications may have been
// missed.
func (w *Worker) listen(ctx context.Context, wake chan<- struct{}) {
	for ctx.Err() == nil {
		err := w.listenOnce(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		w.cfg.Logger.Warn("skiplocked: listener failed; polling until it reconnects", "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(w.cfg.PollInterval):
		}
	}
}

func (w *Worker) listenOnce(ctx context.Context, wake chan<- struct{}) error {
	conn, err := pgx.ConnectConfig(ctx, w.pool.Config().ConnConfig.Copy())
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{NotifyChannel}.Sanitize()); err != nil {
		return err
	}
	poke(wake)
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n.Payload == w.queue {
			poke(wake)
		}
	}
}

func poke(c chan<- struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}
