package pglock

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	mrand "math/rand/v2"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// A handoff notification only wakes a waiter. A role that can read the queue
// (here one granted SELECT on pgfence.lock_queue and nothing else) learns
// every waiter's key and wait id and may send any payload on the handoff
// channel: the current holder's token, the next token (what a real handoff
// would say), a higher or lower one, another waiter's key or wait id. None of
// them makes Acquire return, nor does a tag the forger can compute (it does
// not know the lease key nor the secret of pgfence.handoff_secret): each waiter wakes, reads its grant in the
// database, finds none and waits on. The real releases then hand the lease
// to the waiters in order, with the tokens the database granted.
func TestHandoffForgedNotification(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := testCtx(t, 2*time.Minute)
	const name = "handoff-forged"

	// The forger: may connect and read the queue, nothing else.
	role := fmt.Sprintf("forger_%d_%04d", time.Now().UnixNano()%1_000_000, mrand.IntN(10000))
	id := pgx.Identifier{role}.Sanitize()
	for _, stmt := range []string{
		"CREATE ROLE " + id + " LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE",
		"GRANT USAGE ON SCHEMA pgfence TO " + id,
		"GRANT SELECT ON pgfence.lock_queue TO " + id,
	} {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, stmt := range []string{"DROP OWNED BY " + id + " CASCADE", "DROP ROLE IF EXISTS " + id} {
			if _, err := pool.Exec(ctx, stmt); err != nil {
				t.Logf("%s: %v", stmt, err)
			}
		}
	})
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	forger := pgtest.PoolFor(t, u.String()) // closed before the role is dropped

	owner := newLocker(t, pool, &Config{Holder: "owner"})
	held := mustAcquire(t, owner, name, time.Minute)
	type queued struct {
		holder       string
		sig          <-chan string
		res          <-chan acquired
		wkey, waitID int64
		keyHash      []byte
	}
	var ws []*queued
	for _, h := range []string{"a", "b"} {
		l := newLocker(t, pool, &Config{Holder: h, PollInterval: 30 * time.Second})
		q := &queued{holder: h, sig: waitSignal(l)}
		q.res = acquireAsync(ctx, l, name, time.Minute)
		<-q.sig // queued and asleep
		if err := forger.QueryRow(ctx, "SELECT wkey, wait_id, key_hash FROM pgfence.lock_queue WHERE name = $1 AND holder = $2", name, h).Scan(&q.wkey, &q.waitID, &q.keyHash); err != nil {
			t.Fatalf("the forger reads %s's queue row: %v", h, err)
		}
		ws = append(ws, q)
	}
	a, b := ws[0], ws[1]
	tok := held.Token()
	far := time.Now().Add(time.Hour).UnixMicro()
	type forged struct {
		what    string
		to      *queued // the waiter whose key starts the payload: it wakes
		payload string
	}
	var cases []forged
	for _, w := range ws {
		for _, c := range []struct {
			what  string
			token int64
		}{
			{"the current holder's token", tok},
			{"the next token", tok + 1},
			{"a higher token", tok + 1000},
			{"a lower token", 1},
		} {
			cases = append(cases, forged{w.holder + ": " + c.what, w, fmt.Sprintf("%d %d %d %d", w.wkey, w.waitID, c.token, far)})
		}
	}
	cases = append(cases,
		forged{"a's key, b's wait id", a, fmt.Sprintf("%d %d %d %d", a.wkey, b.waitID, tok+1, far)},
		forged{"b's key, a's wait id", b, fmt.Sprintf("%d %d %d %d", b.wkey, a.waitID, tok+1, far)},
	)
	// Payloads with a tag (migration 00010): the forger knows everything of
	// the queue row but the lease key, so it tries what it can compute.
	for _, w := range ws {
		msg := fmt.Sprintf("%d %d %d %d %d", w.wkey, w.waitID, tok+1, far, time.Hour.Microseconds())
		khh := sha256.Sum256(w.keyHash)
		for _, c := range []struct {
			what string
			tag  []byte
		}{
			{"a random tag", randomBytes(t, sha256.Size)},
			{"a tag keyed with the key's hash", handoffTag(w.keyHash, msg+" "+name)},
			{"a tag keyed with the hash of the key's hash", handoffTag(khh[:], msg+" "+name)},
			{"a tag of the message alone", func() []byte { h := sha256.Sum256([]byte(msg)); return h[:] }()},
		} {
			cases = append(cases, forged{w.holder + ": " + c.what, w, msg + " " + hex.EncodeToString(c.tag)})
		}
	}
	for _, c := range cases {
		if _, err := forger.Exec(ctx, "SELECT pg_notify($1, $2)", handoffChannel, c.payload); err != nil {
			t.Fatalf("%s: %v", c.what, err)
		}
		// The woken waiter reads its grant and, finding none, sleeps again
		// (its poll interval is 30 s: a sleep within 20 s follows the
		// notification). It must not have returned.
		select {
		case <-c.to.sig:
		case r := <-a.res:
			t.Fatalf("forged %s (%q): waiter a returned (lease %v, err %v): a notification granted a lease", c.what, c.payload, r.lease, r.err)
		case r := <-b.res:
			t.Fatalf("forged %s (%q): waiter b returned (lease %v, err %v): a notification granted a lease", c.what, c.payload, r.lease, r.err)
		case <-time.After(20 * time.Second):
			t.Fatalf("forged %s (%q) did not wake waiter %s", c.what, c.payload, c.to.holder)
		}
	}
	if info := inspect(t, pool, name); info.Holder != "owner" || info.Token != tok {
		t.Fatalf("lock changed under forged notifications: %+v", info)
	}
	if n := queueLen(t, pool, name); n != 2 {
		t.Fatalf("%d waiters queued after the forged notifications, want 2", n)
	}

	// The real handoffs: a, then b, each with the token the database granted.
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	ra := <-a.res
	if ra.err != nil {
		t.Fatal(ra.err)
	}
	if ra.lease.Token() != tok+1 {
		t.Fatalf("a was handed token %d, want %d", ra.lease.Token(), tok+1)
	}
	if info := inspect(t, pool, name); info.Holder != "a" || info.Token != tok+1 || !info.ExpiresAt.Equal(ra.lease.ExpiresAt()) {
		t.Fatalf("row %+v, a's lease token %d expiry %v", info, ra.lease.Token(), ra.lease.ExpiresAt())
	}
	select {
	case r := <-b.res:
		t.Fatalf("b returned (%v, %v) while a holds the lease", r.lease, r.err)
	default:
	}
	if err := ra.lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
	rb := <-b.res
	if rb.err != nil {
		t.Fatal(rb.err)
	}
	if rb.lease.Token() != tok+2 {
		t.Fatalf("b was handed token %d, want %d", rb.lease.Token(), tok+2)
	}
	if err := rb.lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

func randomBytes(t testing.TB, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}
