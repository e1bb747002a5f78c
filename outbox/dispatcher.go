package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/permanent"
	"github.com/pgfence/pgfence/internal/workerclaim"
	"github.com/pgfence/pgfence/observe"
	"github.com/pgfence/pgfence/skiplocked"
)

// Delivery is one attempt to deliver an intent, as a [Handler] sees it.
type Delivery struct {
	// ID is the intent's id.
	ID int64
	// Topic, Key, LockName, Token and Payload are the intent's, as recorded
	// by [Enqueue] (Payload as PostgreSQL prints the stored jsonb, not the
	// bytes Enqueue was given). Send Key to the receiving system so that it
	// applies the effect once however many attempts reach it.
	Topic    string
	Key      string
	LockName string
	Token    int64
	Payload  json.RawMessage
	// Attempt is this attempt's number, from 1; MaxAttempts is the last one.
	Attempt     int
	MaxAttempts int
	// CreatedAt is the database time the intent was recorded.
	CreatedAt time.Time
}

// Handler delivers one intent. Return nil when the receiving system has the
// effect (or already had it: a repeated key), an error to retry after the
// backoff (dead after the last attempt), or [Permanent](err) to send the
// intent to dead at once. ctx is cancelled when the dispatcher loses the
// claim or shuts down (see [skiplocked.Handler]); honour it.
//
// A Handler may run more than once for one intent: after a failed attempt,
// and when a dispatcher dies or pauses after the effect but before its
// success is recorded. The receiver makes that one effect by deduplicating
// on Key.
type Handler func(ctx context.Context, d Delivery) error

// Permanent wraps err so that the [Dispatcher] sends the intent to dead at
// once instead of retrying it. Permanent(nil) is a permanent failure too,
// recorded as "permanent failure".
func Permanent(err error) error { return permanent.Wrap(err) }

// Config tunes a [Dispatcher]. A nil *Config uses every default. The fields
// are those of [skiplocked.Config].
type Config struct {
	// Holder identifies this dispatcher in pgfence.jobs.holder. Defaults to
	// "<hostname>/<pid>/<random hex>".
	Holder string
	// Concurrency is the number of deliveries in flight, 1..1000. Defaults to 4.
	Concurrency int
	// BatchSize is the most intents one claim takes. Defaults to Concurrency.
	BatchSize int
	// ClaimTTL is how long a claim lasts without a heartbeat: a dispatcher
	// that dies leaves its intents for others after at most ClaimTTL.
	// Defaults to 30s.
	ClaimTTL time.Duration
	// PollInterval is how often the dispatcher looks for intents when no
	// notification arrives. Defaults to 1s.
	PollInterval time.Duration
	// PollOnly disables LISTEN (for PgBouncer in transaction pooling mode).
	// Defaults to false.
	PollOnly bool
	// Backoff gives the delay before the retry of a failed attempt
	// (1-based). A panic in it, or a runtime.Goexit, is logged and
	// [skiplocked.DefaultBackoff] used instead (see [skiplocked.Config]).
	// Defaults to [DefaultBackoff].
	Backoff func(attempt int) time.Duration
	// ShutdownTimeout is how long deliveries in flight may run after Run's
	// context is cancelled before their contexts are cancelled. Defaults to
	// 10s.
	ShutdownTimeout time.Duration
	// Logger receives errors the dispatcher recovers from. Defaults to
	// discarding them.
	Logger *slog.Logger
	// Metrics receives the claim metrics of package skiplocked (queue
	// "outbox:<topic>") and [metricdefs.OutboxDeliveriesTotal] and
	// [metricdefs.OutboxDeliverySeconds] by topic. Defaults to nil: nothing is
	// recorded.
	Metrics observe.Metrics
}

// DefaultBackoff is the retry delay after failed attempt n: 1s, 2s, 4s, ...
// up to 1h, each drawn at random from its upper half (jitter), so that
// intents failed together are not retried together.
func DefaultBackoff(n int) time.Duration {
	d := time.Hour
	if n < 13 {
		d = min(time.Second<<max(n-1, 0), time.Hour)
	}
	return d/2 + rand.N(d/2+1)
}

// Dispatcher delivers the intents of one topic with a [Handler]: at least
// once, with leased claims on pgfence.jobs ([skiplocked.Worker]), retries
// with backoff, dead after the last attempt, LISTEN/NOTIFY wake-ups with a
// polling fallback and graceful shutdown. Intents are claimed about in the
// order they became due (by the time they were recorded, or their
// NotBefore, retries by their backoff) but delivered concurrently and
// retried independently:
// no delivery order is guaranteed, not even per key. Run as many
// dispatchers of a topic, in as many processes, as you like.
//
// A Dispatcher sends the statements of its Worker and no more: each claim
// statement also returns the intents of the jobs it claims, and completions
// are batched, so a delivery sends no statement of its own. A claimed
// intent waits in memory until its delivery: a Dispatcher holds at most
// Concurrency + 2 × BatchSize of them, payloads included (keep payloads to
// references to large data, not the data).
type Dispatcher struct {
	topic   string
	pool    *pgxpool.Pool
	handler Handler
	metrics observe.Metrics
	worker  *skiplocked.Worker

	// claimed holds the intents the claims returned with their jobs
	// (ClaimOutboxJobs), by job id, until the job's delivery takes its
	// intent, the Worker reports its claim lost, or Run returns.
	mu      sync.Mutex
	claimed map[int64]claimedIntent
	// ran: Run or Drain was called (only the first call runs; the ones
	// the Worker refuses must not forget the running call's intents).
	ran atomic.Bool
}

// claimedIntent is an intent read by the claim of its job: the Delivery
// without the attempt, and the claim token of that claim.
type claimedIntent struct {
	claimToken int64
	del        Delivery
}

// NewDispatcher checks its arguments and returns a dispatcher of topic's
// intents to h. It does no I/O. cfg may be nil.
func NewDispatcher(pool *pgxpool.Pool, topic string, h Handler, cfg *Config) (*Dispatcher, error) {
	const op = "outbox.NewDispatcher"
	if nilcheck.IsNil(pool) {
		return nil, invalid(op, "pool", "nil: pass a *pgxpool.Pool")
	}
	if err := validateTopic(op, "topic", topic); err != nil {
		return nil, err
	}
	if h == nil {
		return nil, invalid(op, "h", "nil handler")
	}
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	if c.Backoff == nil {
		c.Backoff = DefaultBackoff
	}
	d := &Dispatcher{topic: topic, pool: pool, handler: h, metrics: metricdefs.OrNop(c.Metrics),
		claimed: map[int64]claimedIntent{}}
	w, err := skiplocked.NewWorker(pool, queuePrefix+topic, d.deliver, &skiplocked.Config{
		Holder: c.Holder, Concurrency: c.Concurrency, BatchSize: c.BatchSize, ClaimTTL: c.ClaimTTL,
		PollInterval: c.PollInterval, PollOnly: c.PollOnly, Backoff: c.Backoff, ShutdownTimeout: c.ShutdownTimeout,
		Logger: c.Logger, Metrics: c.Metrics,
		OnClaimLost: func(_ context.Context, j skiplocked.Job, _ *pgfence.Error) { d.forget(j.ID, j.ClaimToken) },
	})
	if err != nil {
		return nil, &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Name: topic, Reason: "cfg: refused by skiplocked.NewWorker", Err: err}
	}
	// The Worker claims with ClaimOutboxJobs: each claim statement returns
	// the intents of the jobs it claimed, so a delivery sends no statement.
	workerclaim.Set(w, d.claim)
	d.worker = w
	metricdefs.InitTopic(context.Background(), d.metrics, topic)
	return d, nil
}

// Topic returns the topic this dispatcher delivers.
func (d *Dispatcher) Topic() string { return d.topic }

// Holder returns the identity this dispatcher writes into the claims it takes.
func (d *Dispatcher) Holder() string { return d.worker.Holder() }

// Run delivers intents until ctx is cancelled, then shuts down gracefully
// (see [skiplocked.Worker.Run]) and returns nil. Run or Drain may be called
// once per Dispatcher.
func (d *Dispatcher) Run(ctx context.Context) error {
	if d.ran.CompareAndSwap(false, true) {
		defer d.forgetAll()
	}
	return d.worker.Run(ctx)
}

// Drain delivers intents until the topic has none waiting or in flight, then
// returns what it did (see [skiplocked.Worker.Drain]): for batch jobs and
// tests.
func (d *Dispatcher) Drain(ctx context.Context) (skiplocked.Summary, error) {
	if d.ran.CompareAndSwap(false, true) {
		defer d.forgetAll()
	}
	return d.worker.Drain(ctx)
}

// Summary returns what the dispatcher did so far (Completed: delivered).
func (d *Dispatcher) Summary() skiplocked.Summary { return d.worker.Summary() }

// claim is the Worker's claim statement (see workerclaim): the leased claim
// of pgfence.job_claim and, in the same statement, the intent of each job
// claimed, kept for its delivery.
func (d *Dispatcher) claim(ctx context.Context, db dbsqlc.DBTX, arg dbsqlc.ClaimJobsParams) ([]dbsqlc.PgfenceJob, error) {
	rows, err := queries.ClaimOutboxJobs(ctx, db, dbsqlc.ClaimOutboxJobsParams(arg))
	if err != nil {
		return nil, err
	}
	jobs := make([]dbsqlc.PgfenceJob, len(rows))
	d.mu.Lock()
	defer d.mu.Unlock()
	for i, r := range rows {
		jobs[i] = dbsqlc.PgfenceJob{
			ID: r.ID, Queue: r.Queue, Payload: r.Payload, Priority: r.Priority, RunAt: r.RunAt, Attempts: r.Attempts,
			MaxAttempts: r.MaxAttempts, State: r.State, Holder: r.Holder, ClaimToken: r.ClaimToken,
			ClaimExpiresAt: r.ClaimExpiresAt, LastError: r.LastError, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt,
			FinishedAt: r.FinishedAt, ClaimOutcome: r.ClaimOutcome, ClaimKeyHash: r.ClaimKeyHash,
		}
		if !r.IntentFound || !r.ClaimToken.Valid {
			continue // read by the delivery (see ClaimOutboxJobs)
		}
		d.claimed[r.ID] = claimedIntent{claimToken: r.ClaimToken.Int64, del: Delivery{
			ID: r.ID, Topic: r.IntentTopic, Key: r.IntentIdempotencyKey, LockName: r.IntentLockName, Token: r.IntentToken,
			Payload: json.RawMessage(r.IntentPayload), CreatedAt: r.IntentCreatedAt,
		}}
	}
	return jobs, nil
}

// take returns, and forgets, the intent the claim of j read with it.
func (d *Dispatcher) take(j skiplocked.Job) (Delivery, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	c, ok := d.claimed[j.ID]
	if !ok || c.claimToken != j.ClaimToken {
		return Delivery{}, false
	}
	delete(d.claimed, j.ID)
	return c.del, true
}

// forget drops the intent kept for the claim (job id, claim token) of a job
// that will not be delivered under it.
func (d *Dispatcher) forget(id, claimToken int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if c, ok := d.claimed[id]; ok && c.claimToken == claimToken {
		delete(d.claimed, id)
	}
}

// forgetAll drops the intents of the claims released at shutdown.
func (d *Dispatcher) forgetAll() {
	d.mu.Lock()
	defer d.mu.Unlock()
	clear(d.claimed)
}

// deliver is the skiplocked handler: take the intent the claim returned
// with the job (or read it, when the claim's snapshot did not show it),
// call the user's handler, count the outcome.
func (d *Dispatcher) deliver(ctx context.Context, j skiplocked.Job) error {
	del, ok := d.take(j)
	if !ok {
		row, err := queries.GetOutboxIntent(ctx, d.pool, j.ID)
		if isNoRows(err) {
			return skiplocked.Permanent(&pgfence.Error{Op: "outbox.Dispatcher", Kind: pgfence.ErrNotFound, Name: j.Queue,
				Reason: fmt.Sprintf("job %d has no outbox intent (inserted into pgfence.jobs directly, not through Enqueue)", j.ID)})
		}
		if err != nil {
			return translate("outbox.Dispatcher", nil, err)
		}
		del = Delivery{
			ID: row.ID, Topic: row.Topic, Key: row.IdempotencyKey, LockName: row.LockName, Token: row.Token,
			Payload: json.RawMessage(row.Payload), CreatedAt: row.CreatedAt,
		}
	}
	del.Attempt, del.MaxAttempts = j.Attempts, j.MaxAttempts
	start := time.Now()
	err := d.call(ctx, del)
	d.metrics.Observe(ctx, metricdefs.OutboxDeliverySeconds, time.Since(start).Seconds(), d.topic)
	switch {
	case err == nil:
		d.metrics.Add(ctx, metricdefs.OutboxDeliveriesTotal, 1, d.topic, metricdefs.DeliveryDelivered)
		return nil
	case permanent.Is(err): // outbox.Permanent or skiplocked.Permanent: one type
		d.metrics.Add(ctx, metricdefs.OutboxDeliveriesTotal, 1, d.topic, metricdefs.DeliveryPermanent)
		return err
	default:
		d.metrics.Add(ctx, metricdefs.OutboxDeliveriesTotal, 1, d.topic, metricdefs.DeliveryFailed)
		return err
	}
}

// call calls the handler, turning a panic into an error.
func (d *Dispatcher) call(ctx context.Context, del Delivery) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("outbox: handler panic: %v", r)
		}
	}()
	return d.handler(ctx, del)
}
