package faultsuite

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/outbox"
	"github.com/pgfence/pgfence/pglock"
)

// SQLSTATEs of pgfence.outbox_enqueue the outbox door test expects besides
// the door's (sqlStateDenied, sqlStateBadArgment).
const (
	sqlStateLeaseNotHeld = "PF012" // the lease is released, expired, or held with another key
	sqlStateStaleToken   = "PF003" // a newer grant of the lock exists
	sqlStateNotIssued    = "PF002" // the lock never issued the token
	sqlStateBadToken     = "PF007" // token NULL or <= 0
	sqlStateNullValue    = "22004" // payload NULL
	sqlStateCheck        = "23514" // payload over 1 MiB (constraint outbox_payload_size)
)

// enqueueArgs are the arguments of pgfence.outbox_enqueue; nil is NULL.
type enqueueArgs struct {
	lock, token, key, topic, idem, payload, attempts any
}

// call runs pgfence.outbox_enqueue(a) on db and returns its error.
func (a enqueueArgs) call(ctx context.Context, db *pgxpool.Pool) error {
	_, err := db.Exec(ctx, `SELECT * FROM pgfence.outbox_enqueue($1::text, $2::bigint, $3::bytea, $4::text, $5::text,
		$6::jsonb, $7::integer, NULL)`, a.lock, a.token, a.key, a.topic, a.idem, a.payload, a.attempts)
	return err
}

// TestOutboxDoor: as a role with exactly docs/migrations.md's grants, a
// direct write to pgfence.outbox fails with permission denied, and
// pgfence.outbox_enqueue records an intent only under the live lease held
// with its key: the holder's name and token (public) with another key, the
// key of a released or of an expired lease, a stale token and a token never
// issued are refused with their SQLSTATE, every bad argument too, and none
// of them records an intent or a delivery job. The honest holder's enqueue
// works, in a transaction checked at COMMIT, and the same key again is a
// duplicate.
func TestOutboxDoor(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_, admin, app, role := integritySetup(t, ctx)

	// victim: held at token 1; released: granted and released (its token is
	// still the latest); expired: granted and expired on the database's
	// clock (as the owner of pgfence.locks: no sleep); handed: granted to
	// "old", released, granted to "new".
	victimL := newIntegLocker(t, app, pglock.Config{Holder: "victim"})
	other := newIntegLocker(t, app, pglock.Config{Holder: "other"})
	victim, err := victimL.TryAcquire(ctx, "pay", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	released, err := other.TryAcquire(ctx, "released", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := released.Release(ctx); err != nil {
		t.Fatal(err)
	}
	expired, err := other.TryAcquire(ctx, "expired", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if tag, err := admin.Exec(ctx, "UPDATE pgfence.locks SET expires_at = now() - interval '1 second' WHERE name = 'expired'"); err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("expire the lease: %v", err)
	}
	old, err := other.TryAcquire(ctx, "handed", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Release(ctx); err != nil {
		t.Fatal(err)
	}
	cur, err := victimL.TryAcquire(ctx, "handed", time.Minute)
	if err != nil || cur.Token() != old.Token()+1 {
		t.Fatalf("the second grant of handed: %v (token %d)", err, tokenOf(cur))
	}

	recorded := func() string {
		t.Helper()
		var intents, jobs int
		if err := admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM pgfence.outbox), (SELECT count(*) FROM pgfence.jobs)`).Scan(&intents, &jobs); err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf("%d intents, %d jobs; locks %s", intents, jobs, lockRows(t, ctx, admin))
	}
	before := recorded()
	if !strings.HasPrefix(before, "0 intents, 0 jobs") {
		t.Fatalf("before the probes: %s", before)
	}

	// (a) Direct writes: permission denied.
	for _, stmt := range []string{
		fmt.Sprintf(`INSERT INTO pgfence.outbox (id, topic, idempotency_key, lock_name, token, payload)
			VALUES (1, 'payments', 'k-forged', 'pay', %d, '{}')`, victim.Token()),
		"UPDATE pgfence.outbox SET payload = '{}'",
		"DELETE FROM pgfence.outbox",
		"TRUNCATE pgfence.outbox",
		fmt.Sprintf("SELECT pgfence.outbox_token_refused('pay', 'k', %d, %d)", victim.Token(), victim.Token()),
	} {
		if _, err := app.Exec(ctx, stmt); sqlState(err) != sqlStateDenied {
			t.Errorf("%s as %s: %v, want SQLSTATE %s", stmt, role, err, sqlStateDenied)
		}
	}
	_, err = app.CopyFrom(ctx, pgx.Identifier{"pgfence", "outbox"}, []string{"id", "topic", "idempotency_key", "lock_name", "token", "payload"},
		pgx.CopyFromRows([][]any{{int64(1), "payments", "k-copied", "pay", victim.Token(), "{}"}}))
	if sqlState(err) != sqlStateDenied {
		t.Errorf("COPY into pgfence.outbox: %v, want SQLSTATE %s", err, sqlStateDenied)
	}

	// (b) The lease: name and token right, key wrong or lease not held.
	hash := sha256.Sum256(victim.Key())
	good := func(l *pglock.Lease) enqueueArgs {
		return enqueueArgs{lock: l.Name(), token: l.Token(), key: l.Key(), topic: "payments", idem: "k-1", payload: `{"amount":1}`, attempts: 25}
	}
	with := func(a enqueueArgs, f func(*enqueueArgs)) enqueueArgs {
		f(&a)
		return a
	}
	refusals := []struct {
		what  string
		args  enqueueArgs
		state string
		says  string
	}{
		{"the holder's name and token, a made-up key", with(good(victim), func(a *enqueueArgs) { a.key = []byte("mallory's 16-byte key") }),
			sqlStateLeaseNotHeld, "held with another key"},
		{"the holder's name and token, the key's hash", with(good(victim), func(a *enqueueArgs) { a.key = hash[:] }),
			sqlStateLeaseNotHeld, "held with another key"},
		{"the holder's name and token, the hash as text", with(good(victim), func(a *enqueueArgs) { a.key = []byte(fmt.Sprintf("%x", hash)) }),
			sqlStateLeaseNotHeld, "held with another key"},
		{"the holder's name and token, another Locker's key", with(good(victim), func(a *enqueueArgs) { a.key = released.Key() }),
			sqlStateLeaseNotHeld, "held with another key"},
		{"a released lease with its key", good(released), sqlStateLeaseNotHeld, "(released)"},
		{"an expired lease with its key", good(expired), sqlStateLeaseNotHeld, "(expired)"},
		{"a superseded lease with its key", good(old), sqlStateStaleToken, "stale token"},
		{"a superseded token with the new holder's key", with(good(cur), func(a *enqueueArgs) { a.token = old.Token() }),
			sqlStateStaleToken, "stale token"},
		{"a token never issued, with the holder's key", with(good(victim), func(a *enqueueArgs) { a.token = victim.Token() + 100 }),
			sqlStateNotIssued, "issued only"},
		{"a lock that does not exist", with(good(victim), func(a *enqueueArgs) { a.lock = "no such lock" }),
			sqlStateNotIssued, "issued only none"},
	}
	// (c) Bad arguments, the lease otherwise right.
	big := `"` + strings.Repeat("x", 1<<20) + `"`
	for _, c := range []struct {
		what, state, says string
		f                 func(*enqueueArgs)
	}{
		{"NULL lock name", sqlStateBadArgment, "lock_name must be 1 to 512 bytes, got NULL", func(a *enqueueArgs) { a.lock = nil }},
		{"empty lock name", sqlStateBadArgment, "lock_name must be 1 to 512 bytes, got 0 bytes", func(a *enqueueArgs) { a.lock = "" }},
		{"oversized lock name", sqlStateBadArgment, "got 513 bytes", func(a *enqueueArgs) { a.lock = strings.Repeat("n", 513) }},
		{"token 0", sqlStateBadToken, "invalid token 0", func(a *enqueueArgs) { a.token = 0 }},
		{"token -1", sqlStateBadToken, "invalid token -1", func(a *enqueueArgs) { a.token = -1 }},
		{"NULL token", sqlStateBadToken, "invalid token NULL", func(a *enqueueArgs) { a.token = nil }},
		{"NULL key", sqlStateBadArgment, "key must be 16 to 64 random bytes (the lease's key), got NULL", func(a *enqueueArgs) { a.key = nil }},
		{"empty key", sqlStateBadArgment, "got 0 bytes", func(a *enqueueArgs) { a.key = []byte{} }},
		{"short key", sqlStateBadArgment, "got 15 bytes", func(a *enqueueArgs) { a.key = victim.Key()[:15] }},
		{"long key", sqlStateBadArgment, "got 65 bytes", func(a *enqueueArgs) { a.key = make([]byte, 65) }},
		{"NULL topic", sqlStateBadArgment, "topic must be 1 to 100 bytes", func(a *enqueueArgs) { a.topic = nil }},
		{"empty topic", sqlStateBadArgment, "got 0 bytes", func(a *enqueueArgs) { a.topic = "" }},
		{"oversized topic", sqlStateBadArgment, "got 101 bytes", func(a *enqueueArgs) { a.topic = strings.Repeat("t", 101) }},
		{"SQL-looking topic", sqlStateBadArgment, "got another character", func(a *enqueueArgs) { a.topic = "x'; DROP TABLE pgfence.outbox; --" }},
		{"NULL idempotency key", sqlStateBadArgment, "idempotency_key must be 1 to 255 visible ASCII characters, got NULL", func(a *enqueueArgs) { a.idem = nil }},
		{"empty idempotency key", sqlStateBadArgment, "got 0 bytes", func(a *enqueueArgs) { a.idem = "" }},
		{"oversized idempotency key", sqlStateBadArgment, "got 256 bytes", func(a *enqueueArgs) { a.idem = strings.Repeat("k", 256) }},
		{"idempotency key with a newline", sqlStateBadArgment, "got another character", func(a *enqueueArgs) { a.idem = "a\r\nX-Evil: 1" }},
		{"NULL payload", sqlStateNullValue, "payload must not be NULL", func(a *enqueueArgs) { a.payload = nil }},
		{"oversized payload", sqlStateCheck, "payload must be at most 1048576 bytes", func(a *enqueueArgs) { a.payload = big }},
		{"max_attempts 0", sqlStateBadArgment, "max_attempts must be 1 to 1000000, got 0", func(a *enqueueArgs) { a.attempts = 0 }},
		{"max_attempts 1000001", sqlStateBadArgment, "got 1000001", func(a *enqueueArgs) { a.attempts = 1000001 }},
		{"NULL max_attempts", sqlStateBadArgment, "got NULL", func(a *enqueueArgs) { a.attempts = nil }},
	} {
		refusals = append(refusals, struct {
			what  string
			args  enqueueArgs
			state string
			says  string
		}{c.what, with(good(victim), c.f), c.state, c.says})
	}
	for _, c := range refusals {
		err := c.args.call(ctx, app)
		if sqlState(err) != c.state || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: %v, want SQLSTATE %s saying %q", c.what, err, c.state, c.says)
		}
	}
	// Through the Go API, the same refusals are typed.
	for what, l := range map[string]*pglock.Lease{"released": released, "expired": expired} {
		_, err := outbox.Enqueue(ctx, app, l, outbox.Intent{Topic: "payments", Key: "k-" + what, Payload: json.RawMessage(`{}`)})
		if !errors.Is(err, pgfence.ErrLost) {
			t.Errorf("outbox.Enqueue under the %s lease: %v, want pgfence.ErrLost", what, err)
		}
	}
	if _, err := outbox.Enqueue(ctx, app, old, outbox.Intent{Topic: "payments", Key: "k-old", Payload: json.RawMessage(`{}`)}); !errors.Is(err, pgfence.ErrStaleToken) {
		t.Errorf("outbox.Enqueue under the superseded lease: %v, want ErrStaleToken", err)
	}
	if after := recorded(); after != before {
		t.Fatalf("refused enqueues changed something:\nbefore %s\nafter  %s", before, after)
	}

	// (d) The honest holder: in a transaction, checked again at COMMIT; the
	// same key again is the first intent.
	in := outbox.Intent{Topic: "payments", Key: "settle:pay:1", Payload: json.RawMessage(`{"amount":1}`)}
	var first outbox.Result
	err = pgx.BeginFunc(ctx, app, func(tx pgx.Tx) error {
		var err error
		first, err = outbox.Enqueue(ctx, tx, victim, in)
		return err
	})
	if err != nil || first.Duplicate || first.LockName != "pay" || first.Token != victim.Token() {
		t.Fatalf("the holder's enqueue as %s: %+v, %v", role, first, err)
	}
	again, err := outbox.Enqueue(ctx, app, victim, in)
	if err != nil || !again.Duplicate || again.ID != first.ID {
		t.Fatalf("the same key again: %+v, %v; want a duplicate of intent %d", again, err, first.ID)
	}
	if err := good(cur).call(ctx, app); err != nil {
		t.Fatalf("plain SQL with the current holder's key: %v", err)
	}
	var intents, jobs int
	if err := admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM pgfence.outbox),
		(SELECT count(*) FROM pgfence.jobs WHERE queue = 'outbox:payments')`).Scan(&intents, &jobs); err != nil || intents != 2 || jobs != 2 {
		t.Fatalf("%d intents, %d delivery jobs (%v); want 2 and 2", intents, jobs, err)
	}
	if err := victim.Release(ctx); err != nil {
		t.Fatalf("the victim's release after the probes: %v", err)
	}
	if err := cur.Release(ctx); err != nil {
		t.Fatal(err)
	}
}
