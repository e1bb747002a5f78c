package skiplocked

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/holder"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/observe"
)

// Config tunes a [Worker]. A nil *Config uses every default.
type Config struct {
	// Holder identifies this worker in the holder column of its claims,
	// 1..512 bytes. Defaults to "hostname/pid/random" with 8 random hex
	// digits, so that two workers in one process differ.
	Holder string
	// Concurrency is the number of jobs handled at once, 1..1000. Defaults to 4.
	Concurrency int
	// BatchSize is the most jobs one claim statement takes, 1..10,000.
	// The worker holds at most Concurrency + 2*BatchSize claims whose
	// handler has not returned, so the next batches are claimed while the
	// current one is handled; a claim whose handler returned is held until
	// its outcome is written, which is never delayed to fill a batch (see
	// [Worker.Run]). Defaults to Concurrency.
	BatchSize int
	// ClaimTTL is the length of a leased claim on the database clock,
	// 100ms..24h. A claim of a worker that dies comes back
	// after at most ClaimTTL. Defaults to 30s.
	ClaimTTL time.Duration
	// RenewInterval is how often the claims held are extended, in one
	// statement, by ClaimTTL. At least 10ms and shorter than ClaimTTL.
	// Defaults to ClaimTTL / 3.
	RenewInterval time.Duration
	// PollInterval is how often the worker claims when no notification
	// arrives (the fallback when a NOTIFY is missed, and the only trigger in
	// PollOnly mode or for jobs whose run_at is in the future). At least 10ms.
	// Defaults to 1s.
	PollInterval time.Duration
	// PollOnly disables LISTEN, for PgBouncer in transaction pooling mode
	// where LISTEN does not work. Defaults to false: one dedicated
	// connection LISTENs on pgfence_jobs.
	PollOnly bool
	// Backoff gives the retry delay after a failed attempt (1-based).
	// It runs on a goroutine of its own while an outcome writer waits: a
	// panic in it, or a runtime.Goexit (t.FailNow or a require assertion
	// in a test), ends only that goroutine; it is logged and DefaultBackoff
	// used instead, and the failure is recorded. Defaults to
	// [DefaultBackoff].
	Backoff func(attempt int) time.Duration
	// ShutdownTimeout is how long handlers in flight may run after Run's
	// context is cancelled before their own contexts are cancelled (cause
	// a cause matching [pgfence.ErrClosed]). Defaults to 10s.
	ShutdownTimeout time.Duration
	// Logger receives errors the loop recovers from (failed claims, lost
	// claims, listener reconnects). Defaults to discarding them.
	Logger *slog.Logger
	// Metrics receives rows claimed, completed, failed and dead, claims lost
	// and claim latency, labelled by queue (see package observe). Defaults to
	// nil: nothing is recorded. Claims lost counts real losses only: an
	// outcome retried after a lost reply counts as written (see
	// [Summary].ClaimsLost), and the completion of a job the handler
	// completed itself is a completion.
	Metrics observe.Metrics
	// OnClaimLost, when set, is called once for each claim this worker lost,
	// after the job's handler has returned. err matches [pgfence.ErrLost]:
	// Name is the queue, Token the lost claim's token, Holder the job's
	// holder now, and Reason says what happened ("job 7: reclaimed by token
	// 9, state running", "job 7: claim already ended (completed), state
	// completed", ...; Holder and the state are empty when the job could not
	// be read back). [GetJob] reads the job as it is now. Use it to compensate for an effect done outside
	// the database. It is called by a goroutine that writes outcomes, one
	// call at a time, after the outcomes of the batch it came with are
	// written (keep it short: later outcomes wait for it, their claims
	// renewed meanwhile). Each call runs on a goroutine of its own: a panic
	// in it, or a runtime.Goexit (t.FailNow or a require assertion in a
	// test), ends only that call; it is logged, and the Worker goes on (the
	// loss stays counted). Its ctx ends ShutdownTimeout after Run's
	// context ended.
	// Defaults to nil.
	OnClaimLost func(ctx context.Context, job Job, err *pgfence.Error)
}

func newWorker(pool *pgxpool.Pool, queue string, cfg *Config, tx bool) (*Worker, error) {
	op := opNewWorker
	if tx {
		op = opNewTxWorker
	}
	if nilcheck.IsNil(pool) {
		return nil, nilDB(op)
	}
	if err := checkQueue(op, queue); err != nil {
		return nil, err
	}
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	if c.Holder == "" {
		c.Holder = holder.Default()
	}
	if err := checkHolder(op, "Config.Holder", c.Holder); err != nil {
		return nil, err
	}
	maxConns := int(pool.Config().MaxConns)
	if c.Concurrency == 0 {
		c.Concurrency = 4
		if tx {
			c.Concurrency = max(1, min(4, maxConns-2))
		}
	}
	if c.Concurrency < 1 || c.Concurrency > 1000 {
		return nil, invalid(op, "Config.Concurrency", "%d not in 1..1000", c.Concurrency)
	}
	if tx && maxConns < c.Concurrency+2 {
		return nil, invalid(op, "Config.Concurrency", "the pool has at most %d connections; a TxHandler worker with concurrency %d needs %d "+
			"(one per handler transaction, plus renewals, claims and outcomes): raise pool_max_conns or lower Concurrency",
			maxConns, c.Concurrency, c.Concurrency+2)
	}
	if c.BatchSize == 0 {
		c.BatchSize = c.Concurrency
	}
	if err := checkLimit(op, "Config.BatchSize", c.BatchSize); err != nil {
		return nil, err
	}
	if c.ClaimTTL == 0 {
		c.ClaimTTL = 30 * time.Second
	}
	if err := checkTTL(op, "Config.ClaimTTL", c.ClaimTTL); err != nil {
		return nil, err
	}
	if c.RenewInterval == 0 {
		c.RenewInterval = c.ClaimTTL / 3
	}
	if c.RenewInterval < 10*time.Millisecond || c.RenewInterval >= c.ClaimTTL {
		return nil, invalid(op, "Config.RenewInterval", "%s must be at least 10ms and shorter than ClaimTTL %s", c.RenewInterval, c.ClaimTTL)
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.PollInterval < 10*time.Millisecond {
		return nil, invalid(op, "Config.PollInterval", "%s shorter than 10ms", c.PollInterval)
	}
	if c.Backoff == nil {
		c.Backoff = DefaultBackoff
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = 10 * time.Second
	}
	if c.ShutdownTimeout < 0 {
		return nil, invalid(op, "Config.ShutdownTimeout", "negative: %s", c.ShutdownTimeout)
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	metricdefs.InitQueue(context.Background(), metricdefs.OrNop(c.Metrics), queue)
	return &Worker{pool: pool, queue: queue, cfg: c, inflight: map[ClaimRef]*held{}}, nil
}
