package pglock

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// listenHandoffs returns a connection LISTENing on the handoff channel, as
// any role that may connect can.
func listenHandoffs(t *testing.T, ctx context.Context, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	if _, err := conn.Exec(ctx, "LISTEN "+handoffChannel); err != nil {
		t.Fatal(err)
	}
	return conn
}

// A handed lease whose notification carries a tag that checks is taken from
// the payload, with no read; the payload seen by a listener does not hand a
// later wait of the same Locker (same wkey, new wait id) anything.
func TestHandoffTagged(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := testCtx(t, 2*time.Minute)
	const name = "handoff-tagged"
	owner := newLocker(t, pool, &Config{Holder: "owner"})
	held := mustAcquire(t, owner, name, time.Minute)
	tok := held.Token()

	w := newLocker(t, pool, &Config{Holder: "w", PollInterval: 30 * time.Second})
	// Listening before the wait: a (re)connection wakes every waiter to
	// read, which is not what this test counts.
	if err := w.Listen(ctx); err != nil {
		t.Fatal(err)
	}
	sig := waitSignal(w)
	res := acquireAsync(ctx, w, name, time.Minute)
	<-sig
	asleep := time.Now() // after the wait was queued
	spy := listenHandoffs(t, ctx, dsn)
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.lease.Token() != tok+1 {
		t.Fatalf("handed token %d, want %d", r.lease.Token(), tok+1)
	}
	if n := w.handedReads.Load(); n != 0 {
		t.Fatalf("%d HandedLock reads for a tagged handoff, want 0 (the payload is the lease)", n)
	}
	if info := inspect(t, pool, name); info.Holder != "w" || info.Token != tok+1 || !info.ExpiresAt.Equal(r.lease.ExpiresAt()) {
		t.Fatalf("row %+v, lease token %d expiry %v", info, r.lease.Token(), r.lease.ExpiresAt())
	}
	// The local deadline counts from before the wait was queued.
	if d := r.lease.Deadline(); d.After(asleep.Add(time.Minute)) || !d.After(time.Now()) {
		t.Fatalf("deadline %v: want after now and not after the wait's queueing + TTL %v", d, asleep.Add(time.Minute))
	}
	n, err := spy.WaitForNotification(ctx)
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(n.Payload)
	if len(f) != 6 || f[2] != fmt.Sprint(tok+1) {
		t.Fatalf("handoff payload %q: want wkey wait_id token(%d) expiry_us left_us tag", n.Payload, tok+1)
	}

	// A later wait of w: the same queue key (its row is reused), a new wait
	// id. The captured payload, sent again, only wakes it.
	if err := r.lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
	held2 := mustAcquire(t, owner, name, time.Minute)
	drainSignals(sig)
	res2 := acquireAsync(ctx, w, name, time.Minute)
	<-sig
	var wkey string
	if err := pool.QueryRow(ctx, "SELECT wkey::text FROM pgfence.lock_queue WHERE name = $1 AND holder = 'w' AND granted_token IS NULL", name).Scan(&wkey); err != nil {
		t.Fatal(err)
	}
	if wkey != f[0] {
		t.Fatalf("the second wait queued with key %s, the first with %s: the replay would not reach it", wkey, f[0])
	}
	if _, err := pool.Exec(ctx, "SELECT pg_notify($1, $2)", handoffChannel, n.Payload); err != nil {
		t.Fatal(err)
	}
	// Woken, read, asleep again. Another wake-up may come first: the
	// release of w's first lease above notifies pgfence_lock_released (w had
	// waited), and on a busy machine that notification can reach w after its
	// second wait began; w then asks again (no HandedLock read) and sleeps.
	// So wait, sleep by sleep, for the read the replay causes.
	timeout := time.After(20 * time.Second)
	for w.handedReads.Load() == 0 {
		select {
		case <-sig:
		case r := <-res2:
			t.Fatalf("a replayed payload made Acquire return (%v, %v)", r.lease, r.err)
		case <-timeout:
			t.Fatal("the replayed payload did not wake the waiter to read its wait")
		}
	}
	select {
	case r := <-res2:
		t.Fatalf("a replayed payload made Acquire return (%v, %v)", r.lease, r.err)
	default:
	}
	if got := w.handedReads.Load(); got != 1 {
		t.Fatalf("%d HandedLock reads after a replayed payload, want 1", got)
	}
	if err := held2.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r2 := <-res2
	if r2.err != nil {
		t.Fatal(r2.err)
	}
	if r2.lease.Token() != held2.Token()+1 {
		t.Fatalf("second handoff: token %d, want %d", r2.lease.Token(), held2.Token()+1)
	}
	if err := r2.lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// A wait older than half its TTL does not take the lease from the payload:
// its local deadline would count from before the wait, leaving less than
// half the TTL. It reads the lease, and its deadline counts from the read.
func TestHandoffTaggedLongWait(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	ctx := testCtx(t, time.Minute)
	const name = "handoff-tagged-long"
	const ttl = 2 * time.Second
	owner := newLocker(t, pool, &Config{Holder: "owner"})
	held := mustAcquire(t, owner, name, time.Minute)
	w := newLocker(t, pool, &Config{Holder: "w"})
	if err := w.Listen(ctx); err != nil {
		t.Fatal(err)
	}
	sig := waitSignal(w)
	start := time.Now()
	res := acquireAsync(ctx, w, name, ttl)
	<-sig
	// The condition under test is the wait's age: let it pass half the TTL.
	time.Sleep(ttl/2 + 100*time.Millisecond)
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	if n := w.handedReads.Load(); n != 1 {
		t.Fatalf("%d HandedLock reads for a wait of more than half its TTL, want 1", n)
	}
	if d := r.lease.Deadline(); !d.After(start.Add(ttl)) {
		t.Fatalf("deadline %v counts from before the wait (%v + %v)", d, start, ttl)
	}
	if err := r.lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// checkHandoff takes only a payload for this wait whose tag is the one the
// handoff key makes for the name waited for.
func TestCheckHandoff(t *testing.T) {
	k := sha256.Sum256([]byte("handoff key"))
	other := sha256.Sum256([]byte("another key"))
	const (
		msg  = "17 42 7 1796544816584376 29000000"
		name = "orders-leader"
	)
	tagOf := func(key []byte, m, n string) string { return m + " " + hex.EncodeToString(handoffTag(key, m+" "+n)) }
	tagged := func(m string) string { return tagOf(k[:], m, name) }
	good := tagged(msg)
	if tok, exp, left, ok := checkHandoff(good, name, 17, 42, k[:]); !ok || tok != 7 || exp != 1796544816584376 || left != 29000000 {
		t.Fatalf("good payload: %d %d %d %v", tok, exp, left, ok)
	}
	// A name with spaces: the tag covers everything after the payload.
	spaced := "batch 7 of orders"
	if _, _, _, ok := checkHandoff(tagOf(k[:], msg, spaced), spaced, 17, 42, k[:]); !ok {
		t.Fatalf("a name with spaces: refused")
	}
	for what, p := range map[string]string{
		"another key's tag": tagOf(other[:], msg, name),
		// A release of another name's lease (migration 00029): the wait,
		// the key and the grant are this wait's, the name is not.
		"another name's tag":                        tagOf(k[:], msg, "ORDERS-LEADER"),
		"the tag without the name":                  msg + " " + hex.EncodeToString(handoffTag(k[:], msg)),
		"the tag of the name with a trailing space": tagOf(k[:], msg, name+" "),
		"no tag":              msg,
		"another wkey":        tagged("18 42 7 1796544816584376 29000000"),
		"another wait id":     tagged("17 43 7 1796544816584376 29000000"),
		"token 0":             tagged("17 42 0 1796544816584376 29000000"),
		"negative token":      tagged("17 42 -7 1796544816584376 29000000"),
		"token not a number":  tagged("17 42 x 1796544816584376 29000000"),
		"expiry not a number": tagged("17 42 7 soon 29000000"),
		"nothing left":        tagged("17 42 7 1796544816584376 0"),
		"a negative left":     tagged("17 42 7 1796544816584376 -5"),
		"a field less":        tagged("17 42 7 1796544816584376"),
		"a field more":        tagged(msg + " 1"),
		"a short tag":         good[:len(good)-2],
		"a tag not hex":       msg + " " + strings.Repeat("zz", 32),
		"the tag of another token": "17 42 8 1796544816584376 29000000 " +
			good[len(msg)+1:],
		"empty": "",
	} {
		if tok, exp, left, ok := checkHandoff(p, name, 17, 42, k[:]); ok {
			t.Errorf("%s (%q): accepted, token %d expiry %d left %d", what, p, tok, exp, left)
		}
	}
}

// A handoff's expiry counts from the start of the releasing transaction,
// which may come before the waiter queued (a release batch that waited for
// row locks, a slow server). A waiter that counted its TTL from its queueing
// would hold on past the lease's end; it counts what the payload says is
// left instead, so its deadline comes no later than the expiry.
func TestHandoffTaggedReleaseStartedEarlier(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := testCtx(t, time.Minute)
	const name = "handoff-tagged-early"
	const ttl = 10 * time.Second
	owner := newLocker(t, pool, &Config{Holder: "owner"})
	held := mustAcquire(t, owner, name, time.Minute)

	rel, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rel.Close(context.Background()) })
	tx, err := rel.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var began time.Time
	if err := tx.QueryRow(ctx, "SELECT now()").Scan(&began); err != nil {
		t.Fatal(err)
	}
	// The transaction began before this instant, so the lease it hands
	// over ends no later than startedBy + ttl, on any clock.
	startedBy := time.Now()
	// The condition under test: the release's transaction is a second old
	// when the waiter queues.
	time.Sleep(time.Second)

	w := newLocker(t, pool, &Config{Holder: "w", PollInterval: 30 * time.Second})
	if err := w.Listen(ctx); err != nil {
		t.Fatal(err)
	}
	sig := waitSignal(w)
	res := acquireAsync(ctx, w, name, ttl)
	<-sig
	var handed bool
	if err := tx.QueryRow(ctx, "SELECT handed_off FROM pgfence.lock_release($1, $2, $3)", name, held.Token(), held.Key()).Scan(&handed); err != nil || !handed {
		t.Fatalf("release in the old transaction: handed %v, %v", handed, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	if n := w.handedReads.Load(); n != 0 {
		t.Fatalf("%d HandedLock reads: the payload was not used, the test shows nothing", n)
	}
	if !r.lease.ExpiresAt().Equal(began.Add(ttl)) {
		t.Fatalf("expiry %v, want the release transaction's start %v + %v", r.lease.ExpiresAt(), began, ttl)
	}
	if d := r.lease.Deadline(); d.After(startedBy.Add(ttl)) {
		t.Fatalf("local deadline %v is after the latest the lease can end, %v (by %v)", d, startedBy.Add(ttl), d.Sub(startedBy.Add(ttl)))
	}
	if err := r.lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
}
