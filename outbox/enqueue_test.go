package outbox_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/outbox"
	"github.com/pgfence/pgfence/pglock"
)

func intent(key string) outbox.Intent {
	return outbox.Intent{Topic: "payments", Key: key, Payload: json.RawMessage(`{"amount":100}`)}
}

// enqueueSQL calls pgfence.outbox_enqueue with any lock name, token and key
// (what Enqueue takes from a lease), and returns the translated error.
func enqueueSQL(b bundle, lock string, token int64, key []byte, idemKey string) error {
	_, err := b.pool.Exec(b.ctx, "SELECT * FROM pgfence.outbox_enqueue($1, $2, $3, 'payments', $4, '{}')", lock, token, key, idemKey)
	return outbox.TranslateError(err)
}

// TestEnqueueFenced: the latest token records; the same key again is a
// duplicate that reports the first intent; a superseded token is refused as
// a stale fenced write, a forged one as not issued, and nothing is recorded.
func TestEnqueueFenced(t *testing.T) {
	t.Parallel()
	b := setup(t)
	old := b.grant(t, "settle:store-7")

	r, err := outbox.Enqueue(b.ctx, b.pool, old, intent("settle:7:day1"))
	if err != nil || r.Duplicate || r.ID == 0 || r.Token != old.Token() || r.Topic != "payments" || r.LockName != "settle:store-7" {
		t.Fatalf("first enqueue: %+v, %v", r, err)
	}
	again, err := outbox.Enqueue(b.ctx, b.pool, old, outbox.Intent{Topic: "payments",
		Key: "settle:7:day1", Payload: json.RawMessage(`{"amount":999}`)})
	if err != nil || !again.Duplicate || again.ID != r.ID || again.Token != old.Token() {
		t.Fatalf("same key again: %+v, %v; want a duplicate of %d", again, err, r.ID)
	}

	cur := b.regrant(t, old)
	_, err = outbox.Enqueue(b.ctx, b.pool, old, intent("settle:7:day2"))
	refused := pfError(err)
	var pgErr *pgconn.PgError
	if !errors.Is(err, pgfence.ErrStaleToken) || refused == nil || !errors.As(err, &pgErr) {
		t.Fatalf("stale token: %v (%T), want pgfence.ErrStaleToken with the server's error", err, err)
	}
	if refused.Op != "outbox.Enqueue" || refused.Name != old.Name() || refused.Token != old.Token() ||
		!strings.Contains(refused.Reason, fmt.Sprintf("latest token %d ", cur.Token())) ||
		!strings.Contains(refused.Reason, "intent key settle:7:day2)") {
		t.Errorf("stale refusal %+v, want token %d latest %d key settle:7:day2", refused, old.Token(), cur.Token())
	}
	if errors.Is(err, pgfence.ErrLost) {
		t.Errorf("stale token: %v also matches the lease-not-held refusal", err)
	}
	// A stale holder is refused even for a key already recorded.
	if _, err := outbox.Enqueue(b.ctx, b.pool, old, intent("settle:7:day1")); !errors.Is(err, pgfence.ErrStaleToken) {
		t.Fatalf("stale token, existing key: %v", err)
	}
	// Tokens the lock never issued (a lease cannot carry one: plain SQL, with
	// the current holder's key).
	for _, c := range []struct {
		lock  string
		token int64
	}{{"settle:store-7", cur.Token() + 1}, {"settle:store-7", 1 << 62}, {"no such lock", 1},
		{"x'; DROP TABLE pgfence.outbox; --", 1}} {
		err := enqueueSQL(b, c.lock, c.token, cur.Key(), "settle:7:forged")
		refused := pfError(err)
		if !isInvalid(err, "token") || !strings.Contains(refused.Reason, "never issued") || refused.Token != c.token ||
			refused.Name != c.lock || !strings.Contains(refused.Reason, "intent key settle:7:forged)") ||
			pgerr.Code(err) != pgerr.TokenNotIssued {
			t.Fatalf("forged token %d on %q: %v, want ErrInvalid: a token the lock never issued", c.token, c.lock, err)
		}
	}
	if n, jobs := b.counts(t); n != 1 || jobs != 1 {
		t.Fatalf("%d intents and %d jobs recorded, want 1 and 1", n, jobs)
	}
	if r, err := outbox.Enqueue(b.ctx, b.pool, cur, intent("settle:7:day2")); err != nil || r.Duplicate || r.Token != cur.Token() {
		t.Fatalf("current holder: %+v, %v", r, err)
	}
}

// TestEnqueueLeaseNotHeld: a lease whose token is still the lock's latest
// records nothing once it is released or expired, nor with a key that is not
// its own: pgfence.ErrLost. A lease
// that expires after its Enqueue, granted to nobody else, still commits: the
// COMMIT checks the token.
func TestEnqueueLeaseNotHeld(t *testing.T) {
	t.Parallel()
	b := setup(t)
	released := b.grant(t, "settle:released")
	if err := released.Release(b.ctx); err != nil {
		t.Fatal(err)
	}
	expired := b.grant(t, "settle:expired")
	b.expire(t, expired)
	for what, l := range map[string]*pglock.Lease{"released": released, "expired": expired} {
		_, err := outbox.Enqueue(b.ctx, b.pool, l, intent("k-"+what))
		lost := pfError(err)
		if !errors.Is(err, pgfence.ErrLost) || lost == nil || lost.Kind != pgfence.ErrLost {
			t.Fatalf("%s lease: %v (%T), want pgfence.ErrLost", what, err, err)
		}
		if lost.Name != l.Name() || lost.Token != l.Token() || lost.Holder != l.Holder() ||
			!strings.Contains(lost.Reason, "(intent key k-"+what+")") || pgerr.Code(err) != "PF012" {
			t.Errorf("%s lease: refusal %+v, want lock %s token %d", what, lost, l.Name(), l.Token())
		}
		if !strings.Contains(err.Error(), "not held") || lost.Err == nil || !strings.Contains(lost.Err.Error(), what) {
			t.Errorf("%s lease: %q (server: %v) does not say why", what, err, lost.Err)
		}
		if errors.Is(err, pgfence.ErrStaleToken) || errors.Is(err, pgfence.ErrInvalid) {
			t.Errorf("%s lease: %v also matches another refusal", what, err)
		}
	}
	// The holder's name and token with another key (plain SQL: a lease has
	// its own key).
	held := b.grant(t, "settle:held")
	otherKey := b.grantBy(t, b.other, "settle:other").Key()
	for what, key := range map[string][]byte{"a made-up key": []byte("0123456789abcdef"), "another Locker's key": otherKey} {
		err := enqueueSQL(b, held.Name(), held.Token(), key, "k-wrong")
		refused := pfError(err)
		if !errors.Is(err, pgfence.ErrLost) || refused == nil ||
			refused.Name != held.Name() || refused.Token != held.Token() || !strings.Contains(err.Error(), "not held") {
			t.Fatalf("%s: %v (%+v), want pgfence.ErrLost for %s token %d", what, err, refused, held.Name(), held.Token())
		}
	}
	if n, jobs := b.counts(t); n != 0 || jobs != 0 {
		t.Fatalf("%d intents and %d jobs recorded, want none", n, jobs)
	}

	// Expired after its Enqueue, granted to nobody: the COMMIT succeeds.
	tx, err := b.pool.Begin(b.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(b.ctx) }()
	if _, err := outbox.Enqueue(b.ctx, tx, held, intent("k-held")); err != nil {
		t.Fatalf("the holder's enqueue: %v", err)
	}
	b.expire(t, held)
	if err := outbox.TranslateError(tx.Commit(b.ctx)); err != nil {
		t.Fatalf("COMMIT after the lease expired, not granted again: %v", err)
	}
	if n, jobs := b.counts(t); n != 1 || jobs != 1 {
		t.Fatalf("%d intents and %d jobs recorded, want 1 and 1", n, jobs)
	}
}

// TestEnqueueRefusedAtCommit: a grant that commits after Enqueue returned
// but before the holder's COMMIT makes the COMMIT fail; nothing of the
// transaction is recorded.
func TestEnqueueRefusedAtCommit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	old := b.grant(t, "settle:store-7")
	if _, err := b.pool.Exec(b.ctx, "CREATE TABLE settlements (id int PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	tx, err := b.pool.Begin(b.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(b.ctx) }()
	if _, err := tx.Exec(b.ctx, "INSERT INTO settlements VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	if _, err := outbox.Enqueue(b.ctx, tx, old, intent("settle:7:day1")); err != nil {
		t.Fatal(err)
	}
	// The transaction holds no lock on the lock row yet: the next grant is
	// not held back by it.
	cur := b.regrant(t, old)
	err = outbox.TranslateError(tx.Commit(b.ctx))
	if refused := pfError(err); !errors.Is(err, pgfence.ErrStaleToken) || refused == nil ||
		!strings.Contains(refused.Reason, fmt.Sprintf("latest token %d ", cur.Token())) || refused.Token != old.Token() {
		t.Fatalf("commit after a newer grant: %v, want a stale-token refusal", err)
	}
	var n int
	if err := b.pool.QueryRow(b.ctx, "SELECT count(*) FROM settlements").Scan(&n); err != nil || n != 0 {
		t.Fatalf("settlements: %d, %v; want the transaction rolled back", n, err)
	}
	if n, jobs := b.counts(t); n != 0 || jobs != 0 {
		t.Fatalf("%d intents and %d jobs recorded, want none", n, jobs)
	}
}

// TestEnqueueBadInput: every bad input gets its typed error before any SQL
// runs, and nothing is recorded. SQL-looking text is data: as a key it is
// stored verbatim (bind parameters).
func TestEnqueueBadInput(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.grant(t, "settle:store-7")
	with := func(f func(*outbox.Intent)) outbox.Intent {
		in := intent("k-1")
		f(&in)
		return in
	}
	cases := []struct {
		name  string
		lease *pglock.Lease
		in    outbox.Intent
		want  string // the argument named
	}{
		{"nil lease", nil, intent("k-1"), "lease"},
		{"zero lease (token 0)", new(pglock.Lease), intent("k-1"), "lease token"},
		{"empty topic", l, with(func(in *outbox.Intent) { in.Topic = "" }), "Intent.Topic"},
		{"huge topic", l, with(func(in *outbox.Intent) { in.Topic = strings.Repeat("t", 100+1) }), "Intent.Topic"},
		{"SQL-looking topic", l, with(func(in *outbox.Intent) { in.Topic = "x'; DROP TABLE pgfence.outbox; --" }), "Intent.Topic"},
		{"non-ASCII topic", l, with(func(in *outbox.Intent) { in.Topic = "paiements-é" }), "Intent.Topic"},
		{"empty key", l, with(func(in *outbox.Intent) { in.Key = "" }), "Intent.Key"},
		{"huge key", l, with(func(in *outbox.Intent) { in.Key = strings.Repeat("k", outbox.MaxKeyBytes+1) }), "Intent.Key"},
		{"key with a space", l, with(func(in *outbox.Intent) { in.Key = "a b" }), "Intent.Key"},
		{"key with a newline", l, with(func(in *outbox.Intent) { in.Key = "a\r\nX-Evil: 1" }), "Intent.Key"},
		{"nil payload", l, with(func(in *outbox.Intent) { in.Payload = nil }), "Intent.Payload"},
		{"invalid JSON", l, with(func(in *outbox.Intent) { in.Payload = json.RawMessage(`{"a":`) }), "Intent.Payload"},
		{"payload with \\u0000", l, with(func(in *outbox.Intent) { in.Payload = json.RawMessage(`{"a":"\u0000"}`) }), "Intent.Payload"},
		{"payload not UTF-8", l, with(func(in *outbox.Intent) { in.Payload = json.RawMessage("[\"\xff\"]") }), "Intent.Payload"},
		{"payload with an unpaired surrogate", l, with(func(in *outbox.Intent) { in.Payload = json.RawMessage(`"\ud83d"`) }), "Intent.Payload"},
		{"huge payload", l, with(func(in *outbox.Intent) {
			in.Payload = json.RawMessage(`"` + strings.Repeat("x", outbox.MaxPayloadBytes) + `"`)
		}), "Intent.Payload"},
		{"negative max attempts", l, with(func(in *outbox.Intent) { in.MaxAttempts = -1 }), "Intent.MaxAttempts"},
		{"huge max attempts", l, with(func(in *outbox.Intent) { in.MaxAttempts = 1 << 30 }), "Intent.MaxAttempts"},
	}
	for _, c := range cases {
		if _, err := outbox.Enqueue(b.ctx, b.pool, c.lease, c.in); !isInvalid(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	var nilPool *pgxpool.Pool
	var nilTx pgx.Tx
	for _, db := range []pgfence.DBTX{nil, nilPool, nilTx} {
		if _, err := outbox.Enqueue(b.ctx, db, l, intent("k-1")); !isInvalid(err, "db") {
			t.Errorf("nil db %T: %v, want ErrInvalid naming db", db, err)
		}
	}
	if _, err := outbox.Status(b.ctx, nilPool); !isInvalid(err, "db") {
		t.Errorf("Status(nil): %v", err)
	}
	if n, jobs := b.counts(t); n != 0 || jobs != 0 {
		t.Fatalf("bad input recorded %d intents and %d jobs", n, jobs)
	}
	// SQL-looking text where any visible ASCII is allowed: stored verbatim.
	key := `k';DROP_TABLE_pgfence.outbox;--`
	r, err := outbox.Enqueue(b.ctx, b.pool, l, intent(key))
	if err != nil {
		t.Fatal(err)
	}
	var stored string
	if err := b.pool.QueryRow(b.ctx, "SELECT idempotency_key FROM pgfence.outbox WHERE id = $1", r.ID).Scan(&stored); err != nil || stored != key {
		t.Fatalf("stored key %q, %v", stored, err)
	}
}

// TestEnqueueKeysScopedByLock: an idempotency key is unique per lock. The
// holder of another lock enqueueing a key first does not take it: each lock
// records its own intent under the key (both delivered), and the same lock
// with the same key is still one intent.
func TestEnqueueKeysScopedByLock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	squatter := b.grant(t, "other:lock")
	honest := b.grant(t, "settle:store-7")
	in := intent("settle:7:day1")
	sq := in
	sq.Payload = json.RawMessage(`{"amount":1}`)
	first, err := outbox.Enqueue(b.ctx, b.pool, squatter, sq)
	if err != nil || first.Duplicate {
		t.Fatalf("squatter's enqueue: %+v, %v", first, err)
	}
	mine, err := outbox.Enqueue(b.ctx, b.pool, honest, in)
	if err != nil || mine.Duplicate || mine.ID == first.ID || mine.LockName != "settle:store-7" || mine.Token != honest.Token() {
		t.Fatalf("the lock's own enqueue after another lock took the key: %+v, %v; want a new intent of settle:store-7", mine, err)
	}
	again, err := outbox.Enqueue(b.ctx, b.pool, honest, in)
	if err != nil || !again.Duplicate || again.ID != mine.ID {
		t.Fatalf("same lock, same key again: %+v, %v; want a duplicate of %d", again, err, mine.ID)
	}
	var payload string
	if err := b.pool.QueryRow(b.ctx, "SELECT payload::text FROM pgfence.outbox WHERE id = $1", mine.ID).Scan(&payload); err != nil || payload != `{"amount": 100}` {
		t.Fatalf("the lock's intent holds %q (%v), want its own payload", payload, err)
	}
	if intents, jobs := b.counts(t); intents != 2 || jobs != 2 {
		t.Fatalf("%d intents, %d jobs; want 2 and 2", intents, jobs)
	}
}

// TestEnqueuePayloadServerLimit: the payload limit is the table's too (CHECK
// outbox_payload_size): a payload within the client's check whose stored
// text form is over it is refused with ErrInvalidPayload, and plain SQL
// through pgfence.outbox_enqueue is refused by the server. Nothing recorded.
func TestEnqueuePayloadServerLimit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.grant(t, "settle:store-7")
	in := intent("settle:7:big")
	in.Payload = json.RawMessage("[" + strings.Repeat("1,", outbox.MaxPayloadBytes/2-2) + "1]")
	if len(in.Payload) > outbox.MaxPayloadBytes {
		t.Fatalf("test payload is %d bytes", len(in.Payload))
	}
	if _, err := outbox.Enqueue(b.ctx, b.pool, l, in); !isInvalid(err, "payload") {
		t.Fatalf("payload over the server's limit: %v, want ErrInvalid naming the payload", err)
	}
	big := `"` + strings.Repeat("x", 16<<20) + `"`
	_, err := b.pool.Exec(b.ctx, "SELECT * FROM pgfence.outbox_enqueue($1, $2, $3, 'payments', 'k-big', $4::jsonb)",
		"settle:store-7", l.Token(), l.Key(), big)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23514" || pgErr.ConstraintName != "outbox_payload_size" {
		t.Fatalf("16 MiB through plain SQL: %v, want a violation of outbox_payload_size", err)
	}
	if intents, jobs := b.counts(t); intents != 0 || jobs != 0 {
		t.Fatalf("%d intents, %d jobs recorded; want none", intents, jobs)
	}
}

// pfError returns err as a *pgfence.Error, or nil.
func pfError(err error) *pgfence.Error {
	var pe *pgfence.Error
	if !errors.As(err, &pe) {
		return nil
	}
	return pe
}

// isInvalid reports whether err is pgfence.ErrInvalid whose Reason names
// the argument arg.
func isInvalid(err error, arg string) bool {
	pe := pfError(err)
	return errors.Is(err, pgfence.ErrInvalid) && pe != nil && strings.HasPrefix(pe.Reason, arg+": ")
}
