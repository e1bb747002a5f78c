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
type Handler func(ctx context.Context, job Job) error

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
	// nil: nothing is recorded.
	Metrics observe.Metrics
}

// Worker runs a [Handler] over the jobs of one queue of pgfence.jobs with
// leased claims. Create it with [NewWorker] and start it with [Worker.Run].
type Worker struct {
	pool    *pgxpool.Pool
	queue   string
	handler Handler
	cfg     Config
	running atomic.Bool

	mu       sync.Mutex
	inflight map[int64]*held
}

type held struct {
	ref     ClaimRef
	job     Job
	cancel  context.CancelCauseFunc // nil until the handler starts
	lost    bool
	started bool
}

type outcome int

const (
	outComplete outcome = iota
	outFail
	outRelease
	outLost
)

type result struct {
	h       *held
	outcome outcome
	err     error
}

// NewWorker checks its arguments and returns a worker for queue. It does no
// I/O. cfg may be nil.
func NewWorker(pool *pgxpool.Pool, queue string, h Handler, cfg *Config) (*Worker, error) {
	if nilcheck.IsNil(pool) {
		return nil, ErrNilDB
	}
	if err := checkQueue(queue); err != nil {
		return nil, err
	}
	if h == nil {
		return nil, fmt.Errorf("%w: nil handler", ErrInvalidConfig)
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
	if c.Concurrency == 0 {
		c.Concurrency = 4
	}
	if c.Concurrency < 1 || c.Concurrency > 1000 {
		return nil, fmt.Errorf("%w: concurrency %d not in 1..1000", ErrInvalidConfig, c.Concurrency)
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
	return &Worker{pool: pool, queue: queue, handler: h, cfg: c, inflight: map[int64]*held{}}, nil
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
// must honour their ctx. Run may be called once per Worker.
//
// Claims are woken by NOTIFY on [NotifyChannel] (one dedicated connection,
// reconnected on failure) and by polling every [Config.PollInterval]. A
// failed database call is logged and retried at the next poll; completions
// that cannot be written leave the claim to expire, so a job may run more
// than once but a stale worker's outcome never overwrites a newer claim's.
func (w *Worker) Run(ctx context.Context) error {
	if !w.running.CompareAndSwap(false, true) {
		return fmt.Errorf("%w: Run called twice", ErrInvalidConfig)
	}
	capacity := w.cfg.Concurrency + 2*w.cfg.BatchSize
	slots := make(chan struct{}, capacity)
	jobs := make(chan *held, capacity)
	results := make(chan result, capacity)
	wake := make(chan struct{}, 1)
	var stopping atomic.Bool

	jobBase, cancelJobs := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancelJobs(nil)
	bgCtx, stopBg := context.WithCancel(context.WithoutCancel(ctx))

	var bgWG, listenWG, fetchWG, handlerWG, completerWG sync.WaitGroup
	if !w.cfg.PollOnly {
		listenWG.Go(func() { w.listen(ctx, wake) })
	}
	fetchWG.Go(func() { w.fetch(ctx, slots, jobs, wake) })
	for range w.cfg.Concurrency {
		handlerWG.Go(func() { w.handle(jobBase, jobs, results, &stopping) })
	}
	completerWG.Go(func() { w.complete(bgCtx, results, slots) })
	bgWG.Go(func() { w.heartbeat(bgCtx) })

	<-ctx.Done()
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
	return nil
}

// fetch claims batches when there is room and work is likely, and hands the
// jobs to the handlers.
func (w *Worker) fetch(ctx context.Context, slots chan struct{}, jobs chan<- *held, wake <-chan struct{}) {
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
		w.mu.Unlock()
		for _, h := range hs {
			jobs <- h // never blocks: capacity = slots
		}
		hungry = err == nil && len(claimed) == n
		if !hungry {
			poll.Reset(w.cfg.PollInterval)
		}
	}
}

func (w *Worker) handle(base context.Context, jobs <-chan *held, results chan<- result, stopping *atomic.Bool) {
	for h := range jobs {
		w.mu.Lock()
		if stopping.Load() || h.lost {
			lost := h.lost
			w.mu.Unlock()
			if lost {
				results <- result{h: h, outcome: outLost}
			} else {
				results <- result{h: h, outcome: outRelease}
			}
			continue
		}
		jctx, cancel := context.WithCancelCause(base)
		h.cancel, h.started = cancel, true
		w.mu.Unlock()

		err := w.run(jctx, h.job)
		cause := context.Cause(jctx)
		cancel(nil)
		switch {
		case errors.Is(cause, ErrClaimLost):
			results <- result{h: h, outcome: outLost, err: err}
		case err == nil:
			results <- result{h: h, outcome: outComplete}
		case errors.Is(cause, ErrShutdown):
			results <- result{h: h, outcome: outRelease, err: err}
		default:
			results <- result{h: h, outcome: outFail, err: err}
		}
	}
}

// run calls the handler, turning a panic into an error.
func (w *Worker) run(ctx context.Context, j Job) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return w.handler(ctx, j)
}

// complete writes outcomes, batching completions, and frees the slots.
func (w *Worker) complete(ctx context.Context, results <-chan result, slots <-chan struct{}) {
	const maxBatch = 1000
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
		var done, release []ClaimRef
		for _, r := range batch {
			switch r.outcome {
			case outComplete:
				done = append(done, r.h.ref)
			case outRelease:
				release = append(release, r.h.ref)
			case outFail:
				w.fail(ctx, r)
			case outLost:
				observe.OrNop(w.cfg.Metrics).Add(observe.ClaimsLostTotal, 1, w.queue)
				w.cfg.Logger.Warn("skiplocked: claim lost; outcome not written", "job", r.h.ref.JobID, "token", r.h.ref.Token)
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
		w.mu.Unlock()
		for range batch {
			<-slots
		}
	}
}

// connRetries is how many times the worker sends a completion, failure,
// release or heartbeat again after a connection error (the pool may hand
// out a connection whose backend was ended since its last use).
const connRetries = 3

// retryConn runs op, and runs it again up to connRetries times while it fails
// with ErrConnection and ctx allows. Every statement it retries is
// conditional on the claim tokens, so a retry never changes a job the worker
// no longer holds; if a first attempt did commit before its connection
// failed, the retry reports those claims as lost, which the worker logs.
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

func (w *Worker) finish(ctx context.Context, op string, refs []ClaimRef, f func(context.Context, DB, []ClaimRef) ([]ClaimRef, error)) {
	cctx, cancel := context.WithTimeout(ctx, w.cfg.ClaimTTL)
	defer cancel()
	var lost []ClaimRef
	err := retryConn(cctx, func() (err error) {
		lost, err = f(cctx, w.pool, refs)
		return err
	})
	if cl := (*ClaimsLostError)(nil); errors.As(err, &cl) {
		err = nil // counted and logged per claim below
	}
	if err != nil {
		w.cfg.Logger.Error("skiplocked: "+op+" failed; claims will expire", "jobs", len(refs), "err", err)
		return
	}
	m := observe.OrNop(w.cfg.Metrics)
	if op == "complete" && len(refs) > len(lost) {
		m.Add(observe.RowsCompletedTotal, float64(len(refs)-len(lost)), w.queue)
	}
	if len(lost) > 0 {
		m.Add(observe.ClaimsLostTotal, float64(len(lost)), w.queue)
	}
	for _, r := range lost {
		w.cfg.Logger.Warn("skiplocked: "+op+" refused: claim lost", "job", r.JobID, "token", r.Token)
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
	switch {
	case err == nil:
		m.Add(observe.RowsFailedTotal, 1, w.queue)
		if job.State == StateDead {
			m.Add(observe.RowsDeadTotal, 1, w.queue)
		}
	case errors.Is(err, ErrClaimLost):
		m.Add(observe.ClaimsLostTotal, 1, w.queue)
	}
	if err != nil {
		w.cfg.Logger.Warn("skiplocked: fail not written", "job", r.h.ref.JobID, "err", err)
	}
}

// heartbeat extends every claim held, and cancels handlers whose claim is lost.
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
			if !h.lost {
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
			if cl := (*ClaimsLostError)(nil); errors.As(err, &cl) {
				err = nil // the lost claims are cancelled below
			}
			if err != nil {
				w.cfg.Logger.Warn("skiplocked: heartbeat failed", "claims", len(chunk), "err", err)
				continue
			}
			w.mu.Lock()
			for _, r := range lost {
				if h, ok := w.inflight[r.JobID]; ok && h.ref == r {
					h.lost = true
					if h.cancel != nil {
						h.cancel(&ClaimLostError{JobID: r.JobID, Token: r.Token})
					}
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
