package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/nilcheck"
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
// once instead of retrying it.
func Permanent(err error) error { return &permanentError{err} }

type permanentError struct{ err error }

func (e *permanentError) Error() string { return "permanent: " + e.err.Error() }

func (e *permanentError) Unwrap() error { return e.err }

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
	// (1-based). Defaults to [DefaultBackoff].
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
// polling fallback and graceful shutdown. Intents are claimed in the order
// they were recorded but delivered concurrently and retried independently:
// no delivery order is guaranteed, not even per key. Run as many
// dispatchers of a topic, in as many processes, as you like.
type Dispatcher struct {
	topic   string
	pool    *pgxpool.Pool
	handler Handler
	metrics observe.Metrics
	worker  *skiplocked.Worker
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
	d := &Dispatcher{topic: topic, pool: pool, handler: h, metrics: metricdefs.OrNop(c.Metrics)}
	w, err := skiplocked.NewWorker(pool, queuePrefix+topic, d.deliver, &skiplocked.Config{
		Holder: c.Holder, Concurrency: c.Concurrency, BatchSize: c.BatchSize, ClaimTTL: c.ClaimTTL,
		PollInterval: c.PollInterval, PollOnly: c.PollOnly, Backoff: c.Backoff, ShutdownTimeout: c.ShutdownTimeout,
		Logger: c.Logger, Metrics: c.Metrics,
	})
	if err != nil {
		return nil, &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Name: topic, Reason: "cfg: refused by skiplocked.NewWorker", Err: err}
	}
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
func (d *Dispatcher) Run(ctx context.Context) error { return d.worker.Run(ctx) }

// Drain delivers intents until the topic has none waiting or in flight, then
// returns what it did (see [skiplocked.Worker.Drain]): for batch jobs and
// tests.
func (d *Dispatcher) Drain(ctx context.Context) (skiplocked.Summary, error) {
	return d.worker.Drain(ctx)
}

// Summary returns what the dispatcher did so far (Completed: delivered).
func (d *Dispatcher) Summary() skiplocked.Summary { return d.worker.Summary() }

// deliver is the skiplocked handler: load the intent of the claimed job,
// call the user's handler, count the outcome.
func (d *Dispatcher) deliver(ctx context.Context, j skiplocked.Job) error {
	row, err := queries.GetOutboxIntent(ctx, d.pool, j.ID)
	if isNoRows(err) {
		return skiplocked.Permanent(&pgfence.Error{Op: "outbox.Dispatcher", Kind: pgfence.ErrNotFound, Name: j.Queue,
			Reason: fmt.Sprintf("job %d has no outbox intent (inserted into pgfence.jobs directly, not through Enqueue)", j.ID)})
	}
	if err != nil {
		return translate("outbox.Dispatcher", nil, err)
	}
	del := Delivery{
		ID: row.ID, Topic: row.Topic, Key: row.IdempotencyKey, LockName: row.LockName, Token: row.Token,
		Payload: json.RawMessage(row.Payload), Attempt: j.Attempts, MaxAttempts: j.MaxAttempts, CreatedAt: row.CreatedAt,
	}
	start := time.Now()
	err = d.call(ctx, del)
	d.metrics.Observe(ctx, metricdefs.OutboxDeliverySeconds, time.Since(start).Seconds(), d.topic)
	var pe *permanentError
	switch {
	case err == nil:
		d.metrics.Add(ctx, metricdefs.OutboxDeliveriesTotal, 1, d.topic, metricdefs.DeliveryDelivered)
		return nil
	case errors.As(err, &pe):
		d.metrics.Add(ctx, metricdefs.OutboxDeliveriesTotal, 1, d.topic, metricdefs.DeliveryPermanent)
		return skiplocked.Permanent(err)
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
