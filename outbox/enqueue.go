package outbox

import (
	"context"
	"encoding/json"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/joblimit"
	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/pgtext"
	"github.com/pgfence/pgfence/internal/topic"
	"github.com/pgfence/pgfence/pglock"
)

// Limits checked before anything is sent to the database (the table's CHECK
// constraints say the same).
const (
	// maxKeyBytes is the longest idempotency key, in bytes.
	maxKeyBytes = 255
	// maxPayloadBytes is the largest payload, in bytes: intents carry
	// references to large data, not the data.
	maxPayloadBytes = 1 << 20
	// queuePrefix starts the name of the pgfence.jobs queue that delivers a
	// topic: "outbox:" + topic.
	queuePrefix = "outbox:"
)

var queries = dbsqlc.New()

// Intent is one side effect to record. The lease that authorises it is
// passed to [Enqueue] beside it.
type Intent struct {
	// Topic says which [Dispatcher] delivers it: 1..100 bytes of
	// ASCII letters, digits and . _ : / -.
	Topic string
	// Key is the idempotency key, unique per lock (one intent per lock
	// name and key) and sent to the receiver: 1..255 visible ASCII characters. Derive it from
	// the business operation ("settle:store-7:2024-06-01"), not from the
	// attempt, so that every holder that tries the same effect uses the same
	// key.
	Key string
	// Payload is what to send, as JSON (at most 1 MiB; not invalid UTF-8,
	// the escape \u0000 or a surrogate escape without its pair, which jsonb
	// does not store: [pgfence.ErrInvalid]). It is stored as jsonb: the delivery carries the same JSON value as
	// PostgreSQL prints it, not these bytes (object keys sorted, the last of
	// duplicate keys kept, whitespace as PostgreSQL writes it).
	Payload json.RawMessage
	// MaxAttempts is the number of delivery attempts before the intent is
	// dead, 1..1,000,000. Defaults to 25.
	MaxAttempts int
	// NotBefore delays the first delivery. Defaults to now (database clock).
	// Its year (UTC) must be 1..9999 ([pgfence.ErrInvalid] otherwise); a
	// "never" such as time.Unix(math.MaxInt64, 0) is refused, not stored.
	NotBefore time.Time
}

// Result says what [Enqueue] did.
type Result struct {
	// ID is the intent's id (also the id of the pgfence.jobs row that
	// delivers it).
	ID int64
	// Duplicate is true when an intent with the same key was already
	// recorded: nothing new was recorded, and the other fields describe that
	// first intent, which is the one delivered.
	Duplicate bool
	// Topic, LockName and Token are those of the recorded intent.
	Topic    string
	LockName string
	Token    int64
	// CreatedAt is the database time the intent was recorded.
	CreatedAt time.Time
}

// checkLease refuses a nil lease, and one whose token or name cannot be a
// grant's (a zero pglock.Lease): its Key must not be called then.
func checkLease(op string, lease *pglock.Lease) error {
	if lease == nil {
		return invalid(op, "lease", "nil lease: pass the *pglock.Lease that authorises the intent")
	}
	if token := lease.Token(); token <= 0 {
		return invalid(op, "lease token", "%d, must be > 0", token)
	}
	return nil
}

func (in Intent) check(op string) error {
	if err := validateTopic(op, "Intent.Topic", in.Topic); err != nil {
		return err
	}
	if err := validateKey(op, in.Key); err != nil {
		return err
	}
	switch {
	case len(in.Payload) == 0:
		return invalid(op, "Intent.Payload", "empty (key %s); send {} for no data", in.Key)
	case len(in.Payload) > maxPayloadBytes:
		return invalid(op, "Intent.Payload", "%d bytes (key %s), the limit is %d", len(in.Payload), in.Key, maxPayloadBytes)
	case !json.Valid(in.Payload):
		return invalid(op, "Intent.Payload", "not valid JSON (key %s)", in.Key)
	}
	if p := pgtext.JSONProblem(in.Payload); p != "" {
		return invalid(op, "Intent.Payload", "%s (key %s)", p, in.Key)
	}
	if in.MaxAttempts < 0 || in.MaxAttempts > joblimit.MaxMaxAttempts {
		return invalid(op, "Intent.MaxAttempts", "%d not in 1..%d", in.MaxAttempts, joblimit.MaxMaxAttempts)
	}
	if p := joblimit.RunAtProblem(in.NotBefore); p != "" {
		return invalid(op, "Intent.NotBefore", "%s (key %s)", p, in.Key)
	}
	return nil
}

// validateTopic reports whether topic, the argument arg of op, is
// acceptable: 1..100 bytes of ASCII letters, digits and . _ : / -.
func validateTopic(op, arg, t string) error {
	if err := topic.Check(t); err != nil {
		return invalid(op, arg, "%v", err)
	}
	return nil
}

// validateKey reports whether key is acceptable as an idempotency key:
// 1..255 visible ASCII characters (no space, no control
// character: it is sent as an HTTP header).
func validateKey(op, key string) error {
	if key == "" || len(key) > maxKeyBytes {
		return invalid(op, "Intent.Key", "%d bytes, want 1..%d", len(key), maxKeyBytes)
	}
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < '!' || c > '~' {
			return invalid(op, "Intent.Key", "%q: byte %d is not visible ASCII", cutForError(key), i)
		}
	}
	return nil
}

func cutForError(s string) string {
	if len(s) > 80 {
		return s[:80] + "..."
	}
	return s
}

// Enqueue records in into the outbox under lease, run on db: pass the
// transaction of the writes the effect belongs to, so that the intent commits
// with them or not at all. The lock name, the token and the lease key come
// from lease ([pglock.Lease.Name], [pglock.Lease.Token], [pglock.Lease.Key]).
// The intent is recorded only if the token is the latest grant of the lock
// and the lease is held with its key (not released, not expired on the
// database's clock): the token is public, the key is the holder's secret, so
// a session that only read the token cannot record intents in its name.
//
// A superseded holder (a newer grant exists) gets an error matching
// [pgfence.ErrStaleToken]; a token the lock never issued, or a lock that
// does not exist, one matching [pgfence.ErrInvalid] (Reason "token: ...");
// a lease released or expired (or a key that is not the lease's), one
// matching [pgfence.ErrLost]. The errors are [*pgfence.Error]s with the lock
// name, the token and the server's error; Reason gives the lock's latest
// token and the idempotency key.
// Nothing is recorded then. The token is checked again when the transaction
// commits, with the lock row locked until the commit ends: if a grant
// committed in between, the COMMIT fails (SQLSTATE PF003; see
// [TranslateError]) and nothing of the transaction is recorded. A lease that
// merely expires between Enqueue and the COMMIT, granted to nobody else, does
// not fail the COMMIT: the token is still the latest.
//
// If an intent of the lock with in.Key exists, nothing is recorded and the
// Result describes that intent with Duplicate set: the first intent wins.
//
// The payload is stored as jsonb and delivered re-serialised by PostgreSQL:
// the same JSON value, but object keys reordered, duplicate keys reduced to
// the last one and whitespace normalised. A receiver that needs the exact
// bytes (a signature over the body) should get them inside the payload, as a
// string.
//
// Bad input is refused before any SQL runs, with an error matching
// [pgfence.ErrInvalid] whose Reason names the argument: "db", "lease",
// "lease token", "Intent.Topic", "Intent.Key", "Intent.Payload",
// "Intent.MaxAttempts" or "Intent.NotBefore".
func Enqueue(ctx context.Context, db pgfence.DBTX, lease *pglock.Lease, in Intent) (Result, error) {
	const op = "outbox.Enqueue"
	if nilcheck.IsNil(db) {
		return Result{}, invalid(op, "db", "nil: pass a *pgxpool.Pool, *pgx.Conn or pgx.Tx")
	}
	if err := checkLease(op, lease); err != nil {
		return Result{}, err
	}
	if err := in.check(op); err != nil {
		return Result{}, err
	}
	attempts := in.MaxAttempts
	if attempts == 0 {
		attempts = joblimit.DefaultMaxAttempts
	}
	arg := dbsqlc.OutboxEnqueueParams{
		LockName: lease.Name(), Token: lease.Token(), Key: lease.Key(), Topic: in.Topic, IdempotencyKey: in.Key,
		Payload: in.Payload, MaxAttempts: int32(attempts),
	}
	if !in.NotBefore.IsZero() {
		arg.RunAt = &in.NotBefore
	}
	row, err := queries.OutboxEnqueue(ctx, db, arg)
	if err != nil {
		return Result{}, translate(op, lease, err)
	}
	return Result{ID: row.ID, Duplicate: row.Duplicate, Topic: row.Topic, LockName: row.LockName, Token: row.Token,
		CreatedAt: row.CreatedAt}, nil
}
