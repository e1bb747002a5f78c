package pglock

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

func TestValidationBeforeSQL(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	l := newLocker(t, pool, &Config{Holder: "validator"})
	// A second Locker on a closed pool: any SQL would fail with a pool
	// error, so getting the validation error proves no SQL was sent.
	closed, err := pgxpool.New(context.Background(), pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	lc := newLocker(t, closed, nil)
	ctx := testCtx(t, 30*time.Second)

	long := strings.Repeat("n", maxNameBytes+1)
	nameCases := map[string]string{"empty": "", "513 bytes": long, "bad utf8": "a\xffb", "nul": "a\x00b"}
	ttlCases := map[string]time.Duration{"zero": 0, "negative": -time.Second, "sub-minimum": time.Microsecond, "absurd": MaxTTL + time.Nanosecond, "huge": 1<<63 - 1}
	for _, lk := range []*Locker{l, lc} {
		for what, name := range nameCases {
			if _, err := lk.TryAcquire(ctx, name, time.Second); !isInvalid(err, "lock name") {
				t.Errorf("TryAcquire(name %s) = %v, want ErrInvalid (lock name)", what, err)
			}
			if _, err := lk.Acquire(ctx, name, time.Second); !isInvalid(err, "lock name") {
				t.Errorf("Acquire(name %s) = %v, want ErrInvalid (lock name)", what, err)
			}
			if _, err := lk.AcquireMany(ctx, []string{"ok", name}, time.Second); !isInvalid(err, "lock name") {
				t.Errorf("AcquireMany(name %s) = %v, want ErrInvalid (lock name)", what, err)
			}
			if _, err := lk.RenewToken(ctx, name, 1, time.Second); !isInvalid(err, "lock name") {
				t.Errorf("RenewToken(name %s) = %v, want ErrInvalid (lock name)", what, err)
			}
			if err := lk.ReleaseToken(ctx, name, 1); !isInvalid(err, "lock name") {
				t.Errorf("ReleaseToken(name %s) = %v, want ErrInvalid (lock name)", what, err)
			}
			if _, err := lk.NewElector(name, nil); !isInvalid(err, "lock name") {
				t.Errorf("NewElector(name %s) = %v, want ErrInvalid (lock name)", what, err)
			}
			if _, _, err := Leader(ctx, closed, name); !isInvalid(err, "lock name") {
				t.Errorf("Leader(name %s) = %v, want ErrInvalid (lock name)", what, err)
			}
		}
		for what, ttl := range ttlCases {
			if _, err := lk.TryAcquire(ctx, "x", ttl); !isInvalid(err, "lease duration") {
				t.Errorf("TryAcquire(ttl %s) = %v, want ErrInvalid (lease duration)", what, err)
			}
			if _, err := lk.Acquire(ctx, "x", ttl); !isInvalid(err, "lease duration") {
				t.Errorf("Acquire(ttl %s) = %v, want ErrInvalid (lease duration)", what, err)
			}
			if _, err := lk.AcquireMany(ctx, []string{"x"}, ttl); !isInvalid(err, "lease duration") {
				t.Errorf("AcquireMany(ttl %s) = %v, want ErrInvalid (lease duration)", what, err)
			}
			if _, err := lk.RenewToken(ctx, "x", 1, ttl); !isInvalid(err, "lease duration") {
				t.Errorf("RenewToken(ttl %s) = %v, want ErrInvalid (lease duration)", what, err)
			}
			// LeaseDuration 0 is the default (15s).
			if _, err := lk.NewElector("x", &ElectionConfig{LeaseDuration: ttl, RenewDeadline: time.Second, RetryPeriod: time.Millisecond}); ttl != 0 && !isInvalid(err, "lease duration") {
				t.Errorf("NewElector(ttl %s) = %v, want ErrInvalid (lease duration)", what, err)
			}
		}
		for _, tok := range []int64{0, -1, -1 << 63} {
			if _, err := lk.RenewToken(ctx, "x", tok, time.Second); !isInvalid(err, "token") {
				t.Errorf("RenewToken(token %d) = %v, want ErrInvalid (token)", tok, err)
			}
			if err := lk.ReleaseToken(ctx, "x", tok); !isInvalid(err, "token") {
				t.Errorf("ReleaseToken(token %d) = %v, want ErrInvalid (token)", tok, err)
			}
		}
	}
	if _, err := l.AcquireMany(ctx, []string{"a", "b", "a"}, time.Second); !isInvalid(err, "lock names") {
		t.Errorf("AcquireMany(duplicates) = %v, want ErrInvalid (lock name)", err)
	}
	if _, err := l.AcquireMany(ctx, nil, time.Second); !isInvalid(err, "lock names") {
		t.Errorf("AcquireMany(nil) = %v, want ErrInvalid (lock name)", err)
	}
	for _, c := range []struct {
		cfg Config
		arg string
	}{
		{Config{Holder: strings.Repeat("h", maxHolderBytes+1)}, "holder"},
		{Config{Holder: "bad\xff"}, "holder"},
		{Config{Holder: "nul\x00"}, "holder"},
		{Config{Key: make([]byte, minKeyBytes-1)}, "Config.Key"},
		{Config{Key: make([]byte, maxKeyBytes+1)}, "Config.Key"},
		{Config{Key: []byte{}}, "Config.Key"},
		{Config{KeepAliveFraction: 0.9}, "Config.KeepAliveFraction"},
		{Config{KeepAliveFraction: -1}, "Config.KeepAliveFraction"},
		{Config{PollInterval: -time.Second}, "Config.PollInterval"},
		{Config{PollInterval: 5 * time.Millisecond}, "Config.PollInterval"},
	} {
		if _, err := New(pool, &c.cfg); !isInvalid(err, c.arg) {
			t.Errorf("New(%+v) = %v, want ErrInvalid (%s)", c.cfg, err, c.arg)
		}
	}
	for _, n := range []int{minKeyBytes, maxKeyBytes} {
		l, err := New(pool, &Config{Key: make([]byte, n)})
		if err != nil {
			t.Errorf("New(Config.Key of %d bytes) = %v, want accepted", n, err)
		} else {
			_ = l.Close()
		}
	}
	if _, err := New(nil, nil); !isInvalid(err, "pool") {
		t.Errorf("New(nil pool) = %v, want ErrInvalid (pool)", err)
	}
	var nilPool *pgxpool.Pool
	if _, err := Inspect(ctx, nilPool, "x"); !isInvalid(err, "db") {
		t.Errorf("Inspect(typed nil pool) = %v, want ErrInvalid (db)", err)
	}
	if _, err := l.NewElector("e", &ElectionConfig{LeaseDuration: time.Second, RenewDeadline: 2 * time.Second}); !isInvalid(err, "ElectionConfig") {
		t.Errorf("NewElector(renew deadline > lease) = %v", err)
	}
	// Nothing reached the table.
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgfence.locks").Scan(&n); err != nil || n != 0 {
		t.Fatalf("rows after rejected calls = %d, %v; want 0", n, err)
	}
	// Errors carry the kind and a reason.
	_, err = l.TryAcquire(ctx, long, time.Second)
	var inv *pgfence.Error
	if !errors.As(err, &inv) || inv.Kind != pgfence.ErrInvalid || inv.Op != "pglock.TryAcquire" || !strings.Contains(err.Error(), "513 bytes") {
		t.Errorf("error %v does not explain the length", err)
	}
}

func TestSQLLookingNamesStoredVerbatim(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	l := newLocker(t, pool, &Config{Holder: "h'); DELETE FROM pgfence.locks; --"})
	ctx := testCtx(t, 30*time.Second)
	names := []string{
		"x'; DROP TABLE pgfence.locks; --",
		`"; TRUNCATE pgfence.locks; --`,
		"$1", "%", "_", `\`, "a b\tc\nd", "Robert'); DROP TABLE students;--",
		"ключ:42", "🔒", strings.Repeat("é", maxNameBytes/2), // exactly 512 bytes
	}
	for _, name := range names {
		s, err := l.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatalf("TryAcquire(%q): %v", name, err)
		}
		info := inspect(t, pool, name)
		if info.Name != name || !info.Held || info.Holder != l.Holder() || info.Token != s.Token() {
			t.Errorf("row for %q = %+v", name, info)
		}
		if err := s.Release(ctx); err != nil {
			t.Fatalf("Release(%q): %v", name, err)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgfence.locks").Scan(&n); err != nil || n != len(names) {
		t.Fatalf("rows = %d, %v; want %d", n, err, len(names))
	}
}

func TestTryAcquireLockedError(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	a := newLocker(t, pool, &Config{Holder: "a"})
	b := newLocker(t, pool, &Config{Holder: "b"})
	ctx := testCtx(t, 30*time.Second)
	s := mustAcquire(t, a, "job", time.Minute)
	if s.Token() != 1 || s.Name() != "job" || s.Holder() != "a" || s.TTL() != time.Minute {
		t.Fatalf("lease = %q %q %d %v", s.Name(), s.Holder(), s.Token(), s.TTL())
	}
	before := rowJSON(t, pool, "job")
	for _, l := range []*Locker{a, b} { // the same Locker is excluded too
		_, err := l.TryAcquire(ctx, "job", time.Minute)
		var le *pgfence.Error
		if !errors.As(err, &le) || !errors.Is(err, pgfence.ErrLocked) {
			t.Fatalf("TryAcquire on held lock = %v, want a *pgfence.Error matching ErrLocked", err)
		}
		if le.Holder != "a" || !le.ExpiresAt.Equal(s.ExpiresAt()) || le.Name != "job" || le.Op != "pglock.TryAcquire" {
			t.Errorf("locked error = %+v, want pglock.TryAcquire of job: holder a until %v", le, s.ExpiresAt())
		}
	}
	if after := rowJSON(t, pool, "job"); after != before {
		t.Errorf("refused grant changed the row:\n%s\n%s", before, after)
	}
	// Acquire with a short context reports both pgfence.ErrLocked and the deadline
	// when the context ends while waiting. On a loaded machine it may end
	// during a round trip instead: a *pgfence.Error with no Kind matching the
	// deadline.
	sawLocked := false
	for range 5 {
		sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		_, err := b.Acquire(sctx, "job", time.Minute)
		cancel()
		var dbErr *pgfence.Error
		switch {
		case !errors.Is(err, context.DeadlineExceeded):
			t.Errorf("Acquire with expiring ctx = %v, want it to match context.DeadlineExceeded", err)
		case errors.Is(err, pgfence.ErrLocked):
			sawLocked = true
		case !errors.As(err, &dbErr) || dbErr.Kind != nil:
			t.Errorf("Acquire with expiring ctx = %v, want ErrLocked or a database *pgfence.Error", err)
		}
		if sawLocked {
			break
		}
	}
	if !sawLocked {
		t.Errorf("Acquire with an expiring ctx never reported pgfence.ErrLocked")
	}
	// ExpiresAt is the db clock's now() + ttl; Deadline is local and not later
	// than the database expiry in real time.
	if d := time.Until(s.Deadline()); d > time.Minute || d < 50*time.Second {
		t.Errorf("Deadline in %v, want just under 1m", d)
	}
}

// Two Lockers, one name, 1,000 grants: never two holders at once, and every
// grant's token is larger than the one before.
func TestContendedMutualExclusion(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	const rounds = 1000
	lockers := []*Locker{newLocker(t, pool, &Config{Holder: "one"}), newLocker(t, pool, &Config{Holder: "two"})}
	ctx := testCtx(t, 50*time.Second)

	var (
		inside  atomic.Int32
		granted atomic.Int32
		mu      sync.Mutex
		last    int64
		perL    [2]int
		wg      sync.WaitGroup
		errs    = make(chan error, 2)
	)
	for i, l := range lockers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for granted.Load() < rounds {
				s, err := l.Acquire(ctx, "contended", 10*time.Second)
				if err != nil {
					errs <- err
					return
				}
				if n := inside.Add(1); n != 1 {
					errs <- errors.New("two holders at once")
				}
				mu.Lock()
				if s.Token() <= last {
					errs <- errors.New("token did not grow")
				}
				last = s.Token()
				perL[i]++
				mu.Unlock()
				granted.Add(1)
				inside.Add(-1)
				if err := s.Release(ctx); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	info := inspect(t, pool, "contended")
	if info.Token != last || info.Held {
		t.Errorf("final row %+v, want token %d and free", info, last)
	}
	if perL[0] == 0 || perL[1] == 0 {
		t.Errorf("grants per locker %v: no contention", perL)
	}
	t.Logf("%d grants, per locker %v, last token %d", granted.Load(), perL, last)
}

// Seed scenario: A takes a short lease and pauses past it; B acquires with a
// higher token and writes; A's renew and release are refused and change
// nothing; A's Done has fired; A's fenced write is refused by the row.
func TestSeedPausedHolder(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 30*time.Second)
	if _, err := pool.Exec(ctx, `CREATE TABLE invoices (id int PRIMARY KEY, pdf text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO invoices VALUES (42, 'v0', 0)`); err != nil {
		t.Fatal(err)
	}
	fencedWrite := func(token int64, pdf string) int64 {
		tag, err := pool.Exec(ctx, "UPDATE invoices SET pdf = $2, fence = $3 WHERE id = $1 AND fence < $3", 42, pdf, token)
		if err != nil {
			t.Fatal(err)
		}
		return tag.RowsAffected()
	}
	a := newLocker(t, pool, &Config{Holder: "worker-a"})
	b := newLocker(t, pool, &Config{Holder: "worker-b"})

	la := mustAcquire(t, a, "invoice:42", 300*time.Millisecond)
	time.Sleep(450 * time.Millisecond) // A "pauses" (GC, VM stall) past its TTL
	// B waits for the database to expire A's lease (usually no wait at all).
	lb, err := b.Acquire(ctx, "invoice:42", time.Minute)
	if err != nil {
		t.Fatalf("B Acquire after A's expiry: %v", err)
	}
	if time.Now().Before(la.Deadline()) {
		t.Fatal("B was granted the lock before A's local deadline")
	}
	if lb.Token() <= la.Token() {
		t.Fatalf("B token %d not above A token %d", lb.Token(), la.Token())
	}
	if n := fencedWrite(lb.Token(), "B"); n != 1 {
		t.Fatalf("B's fenced write updated %d rows", n)
	}
	select {
	case <-la.Done():
	case <-time.After(time.Second):
		t.Fatal("A.Done() has not fired after its deadline")
	}
	if err := la.Err(); !errors.Is(err, pgfence.ErrLost) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("A.Err() = %v", err)
	}
	if c := context.Cause(la.Context()); !errors.Is(c, pgfence.ErrLost) {
		t.Errorf("A.Context cause = %v", c)
	}

	before := rowJSON(t, pool, "invoice:42")
	if err := la.Renew(ctx); !errors.Is(err, pgfence.ErrLost) {
		t.Errorf("A.Renew = %v, want pgfence.ErrLost", err)
	}
	if _, err := a.RenewToken(ctx, "invoice:42", la.Token(), time.Minute); !errors.Is(err, pgfence.ErrLost) {
		t.Errorf("A RenewToken = %v, want pgfence.ErrLost", err)
	}
	if err := la.Release(ctx); !errors.Is(err, pgfence.ErrLost) {
		t.Errorf("A.Release = %v, want pgfence.ErrLost", err)
	}
	if err := a.ReleaseToken(ctx, "invoice:42", la.Token()); !errors.Is(err, pgfence.ErrLost) {
		t.Errorf("A ReleaseToken = %v, want pgfence.ErrLost", err)
	}
	if after := rowJSON(t, pool, "invoice:42"); after != before {
		t.Errorf("A's stale calls changed the row:\n%s\n%s", before, after)
	}
	// A wakes up and writes with its token: the row refuses it.
	if n := fencedWrite(la.Token(), "A"); n != 0 {
		t.Fatalf("A's stale fenced write updated %d rows", n)
	}
	var pdf string
	if err := pool.QueryRow(ctx, "SELECT pdf FROM invoices WHERE id = 42").Scan(&pdf); err != nil || pdf != "B" {
		t.Fatalf("pdf = %q, %v; want B", pdf, err)
	}
	if lb.Err() != nil {
		t.Errorf("B's lease ended: %v", lb.Err())
	}
}

// A stale holder's release never frees the newer holder's lease, whichever
// field is stale.
func TestStaleReleaseNeverFreesNewer(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 30*time.Second)
	a := newLocker(t, pool, &Config{Holder: "a"})
	b := newLocker(t, pool, &Config{Holder: "b"})
	old := mustAcquire(t, a, "r", 100*time.Millisecond)
	<-old.Done()
	cur, err := b.Acquire(ctx, "r", time.Minute) // waits for the database's expiry
	if err != nil {
		t.Fatal(err)
	}
	before := rowJSON(t, pool, "r")
	// b's holder name with a's key: the holder is a label, the key decides.
	bName := newLocker(t, pool, &Config{Holder: "b"})
	for _, c := range []struct {
		who   string
		l     *Locker
		token int64
	}{
		{"a", a, old.Token()}, {"a", a, cur.Token()}, {"b's name, another key", bName, cur.Token()},
		{"b", b, old.Token()}, {"b", b, cur.Token() + 1},
	} {
		if err := c.l.ReleaseToken(ctx, "r", c.token); !errors.Is(err, pgfence.ErrLost) {
			t.Errorf("ReleaseToken(%s, %d) = %v, want pgfence.ErrLost", c.who, c.token, err)
		}
		if _, err := c.l.RenewToken(ctx, "r", c.token, time.Hour); !errors.Is(err, pgfence.ErrLost) {
			t.Errorf("RenewToken(%s, %d) = %v, want pgfence.ErrLost", c.who, c.token, err)
		}
	}
	if err := old.Release(ctx); !errors.Is(err, pgfence.ErrLost) {
		t.Errorf("old.Release = %v", err)
	}
	if after := rowJSON(t, pool, "r"); after != before {
		t.Errorf("stale calls changed the row:\n%s\n%s", before, after)
	}
	if _, err := a.TryAcquire(ctx, "r", time.Minute); !errors.Is(err, pgfence.ErrLocked) {
		t.Errorf("lock was freed by a stale release: %v", err)
	}
	// The current holder's own token-based calls work.
	exp, err := b.RenewToken(ctx, "r", cur.Token(), time.Hour)
	if err != nil || time.Until(exp) < 50*time.Minute {
		t.Errorf("RenewToken by holder = %v, %v", exp, err)
	}
	if err := b.ReleaseToken(ctx, "r", cur.Token()); err != nil {
		t.Errorf("ReleaseToken by holder: %v", err)
	}
	if info := inspect(t, pool, "r"); info.Held || info.Token != cur.Token() || info.Holder != "" {
		t.Errorf("after release row = %+v", info)
	}
}

func TestTokensGrowAcrossReleases(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 30*time.Second)
	l := newLocker(t, pool, nil)
	var prev int64
	for i := 1; i <= 5; i++ {
		s := mustAcquire(t, l, "grow", time.Minute)
		if s.Token() != int64(i) || s.Token() <= prev {
			t.Fatalf("grant %d token %d (prev %d)", i, s.Token(), prev)
		}
		prev = s.Token()
		if err := s.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if !errors.Is(s.Err(), pgfence.ErrReleased) {
			t.Errorf("Err after release = %v", s.Err())
		}
		if err := s.Release(ctx); err != nil {
			t.Errorf("second Release = %v, want nil", err)
		}
		info := inspect(t, pool, "grow")
		if info.Held || info.Holder != "" || !info.ExpiresAt.IsZero() || info.Token != prev {
			t.Fatalf("released row = %+v; want token kept, holder and expiry NULL", info)
		}
	}
	// An expired lease is taken over with the next token as well.
	s := mustAcquire(t, l, "grow", 50*time.Millisecond)
	<-s.Done()
	s2, err := l.Acquire(ctx, "grow", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if s2.Token() != s.Token()+1 {
		t.Errorf("token after expiry %d, want %d", s2.Token(), s.Token()+1)
	}
}

func TestTokenOverflow(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 30*time.Second)
	l := newLocker(t, pool, nil)
	s := mustAcquire(t, l, "old", time.Minute)
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "UPDATE pgfence.locks SET token = 9223372036854775807 WHERE name = 'old'"); err != nil {
		t.Fatal(err)
	}
	before := rowJSON(t, pool, "old")
	_, err := l.TryAcquire(ctx, "old", time.Minute)
	if !errors.Is(err, pgfence.ErrTokenExhausted) {
		t.Fatalf("TryAcquire at max token = %v, want pgfence.ErrTokenExhausted", err)
	}
	if _, err := l.Acquire(ctx, "old", time.Minute); !errors.Is(err, pgfence.ErrTokenExhausted) {
		t.Fatalf("Acquire at max token = %v, want pgfence.ErrTokenExhausted", err)
	}
	if after := rowJSON(t, pool, "old"); after != before {
		t.Errorf("overflowing grant changed the row:\n%s\n%s", before, after)
	}
}

// The grant and renew statements turn synchronous_commit on for their own
// transaction even when the session default is off, without an extra round
// trip: read the setting back inside a transaction that ran the statement,
// and check it is back to off after an implicit one-statement transaction.
func TestGrantForcesSynchronousCommit(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	ctx := testCtx(t, 30*time.Second)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["synchronous_commit"] = "off"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	show := func(db pgfence.DBTX) string {
		var v string
		if err := db.QueryRow(ctx, "SHOW synchronous_commit").Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	if v := show(conn); v != "off" {
		t.Fatalf("session default = %q, want off", v)
	}
	q := dbsqlc.New()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	key := floorKey("h")
	first, err := q.GrantLock(ctx, tx, dbsqlc.GrantLockParams{Name: "sync", Holder: "h", TtlUs: 60e6, Key: key})
	if err != nil || first.Token.Int64 != 1 {
		t.Fatalf("first GrantLock = %+v, %v", first, err)
	}
	if v := show(tx); v != "on" {
		t.Errorf("synchronous_commit inside the inserting transaction = %q, want on", v)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if r, err := q.ReleaseLock(ctx, conn, dbsqlc.ReleaseLockParams{Name: "sync", Token: first.Token.Int64, Key: key}); err != nil || !r.Released.Bool || r.HandedOff.Bool {
		t.Fatalf("ReleaseLock = %+v, %v", r, err)
	}
	tx, err = conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	row, err := q.GrantLock(ctx, tx, dbsqlc.GrantLockParams{Name: "sync", Holder: "h", TtlUs: 60e6, Key: key})
	if err != nil || !row.Token.Valid {
		t.Fatalf("GrantLock = %+v, %v", row, err)
	}
	if v := show(tx); v != "on" {
		t.Errorf("synchronous_commit inside the granting transaction = %q, want on", v)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if v := show(conn); v != "off" {
		t.Errorf("after commit = %q, want the session's off back (set_config is local)", v)
	}
	tx, err = conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := q.RenewLock(ctx, tx, dbsqlc.RenewLockParams{TtlUs: 60e6, Name: "sync", Token: row.Token.Int64, Key: key}); err != nil || r.ExpiresAt == nil {
		t.Fatal(r, err)
	}
	if v := show(tx); v != "on" {
		t.Errorf("synchronous_commit inside the renewing transaction = %q, want on", v)
	}
	_ = tx.Rollback(ctx)
	// A refused grant (the lock is held) does not set it.
	if r, err := q.GrantLock(ctx, conn, dbsqlc.GrantLockParams{Name: "sync", Holder: "h2", TtlUs: 60e6, Key: floorKey("h2")}); err != nil || r.Token.Valid {
		t.Fatalf("refused grant: %+v, %v", r, err)
	}
	if v := show(conn); v != "off" {
		t.Errorf("after an implicit transaction = %q, want off", v)
	}
}

// A release sends NOTIFY only when a waiter is queued or marked the lock:
// uncontended cycles stay NOTIFY-free. With a waiter queued it hands the
// lease over and notifies handoffChannel with the waiter's key; without one,
// under a recent mark, notifyChannel with the name.
func TestReleaseNotifiesChannel(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := testCtx(t, 30*time.Second)
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{notifyChannel}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	a := newLocker(t, pool, &Config{Holder: "a"})
	b := newLocker(t, pool, &Config{Holder: "b"})
	name := `it's "quoted"`
	s := mustAcquire(t, a, name, time.Minute)
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	n, err := conn.WaitForNotification(short)
	cancel()
	if err == nil {
		t.Fatalf("release without waiters sent %q %q", n.Channel, n.Payload)
	}
	// pgx closes the connection on a cancelled wait: listen again.
	conn, err = pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{notifyChannel}.Sanitize()+"; LISTEN "+pgx.Identifier{handoffChannel}.Sanitize()); err != nil {
		t.Fatal(err)
	}

	s = mustAcquire(t, a, name, time.Minute)
	waiting := waitSignal(b)
	res := acquireAsync(ctx, b, name, time.Minute)
	<-waiting
	if info := rowJSON(t, pool, name); !strings.Contains(info, `"waiting_since": "`) {
		t.Errorf("waiter did not mark the row: %s", info)
	}
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// The release hands the lease to the queued waiter and notifies it alone,
	// by its queue key and the id of its wait, with the new token and
	// expiry, what is left of it, and the tag: "wkey wait_id token expiry_us
	// left_us tag".
	n, err = conn.WaitForNotification(ctx)
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(n.Payload)
	if n.Channel != handoffChannel || len(f) != 6 {
		t.Fatalf("notification %q %q, want %s with \"wkey wait_id token expiry_us left_us tag\"", n.Channel, n.Payload, handoffChannel)
	}
	if tag, herr := hex.DecodeString(f[5]); herr != nil || len(tag) != sha256.Size {
		t.Errorf("payload %q: tag %q is not the hex of %d bytes", n.Payload, f[5], sha256.Size)
	}
	if _, perr := strconv.ParseInt(f[0], 10, 64); perr != nil {
		t.Errorf("payload %q: queue key %q is not an integer", n.Payload, f[0])
	}
	var wait string
	if err := pool.QueryRow(ctx, "SELECT wait_id::text FROM pgfence.lock_queue WHERE wkey = $1", f[0]).Scan(&wait); err != nil || f[1] != wait {
		t.Errorf("payload %q: wait id %q, the queue row has %q (%v)", n.Payload, f[1], wait, err)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.lease.Token() != s.Token()+1 {
		t.Errorf("handed lease token %d, want %d", r.lease.Token(), s.Token()+1)
	}
	if want := fmt.Sprintf("%d %d", r.lease.Token(), r.lease.ExpiresAt().UnixMicro()); f[2]+" "+f[3] != want {
		t.Errorf("payload %q: token and expiry %q, the lease has %q", n.Payload, f[2]+" "+f[3], want)
	}
	var dbExp time.Time
	if err := pool.QueryRow(ctx, "SELECT expires_at FROM pgfence.locks WHERE name = $1", name).Scan(&dbExp); err != nil || !dbExp.Equal(r.lease.ExpiresAt()) {
		t.Errorf("row expiry %v (%v), lease's %v", dbExp, err, r.lease.ExpiresAt())
	}
	// The grant kept the mark (other waiters may still sleep on it), so the
	// next release notifies as well.
	var marked bool
	if err := pool.QueryRow(ctx, "SELECT waiting_since > now() - interval '30 seconds' FROM pgfence.locks WHERE name = $1", name).Scan(&marked); err != nil || !marked {
		t.Errorf("after the waiter's grant the mark is gone (%v, %v)", marked, err)
	}
	if err := r.lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := conn.WaitForNotification(ctx); err != nil || n.Payload != name {
		t.Errorf("release under a recent mark: notification %v, %v", n, err)
	}
}

// A grant that waits behind a row lock for longer than its TTL is not
// returned as a lease already past its deadline: TryAcquire gives the token
// back and reports a retryable ErrSlowGrant with the token; the lock
// is free again and the next grant gets a larger token.
func TestSlowGrantIsGivenBack(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	l := newLocker(t, pool, &Config{Holder: "slow", PollOnly: true})
	ctx := testCtx(t, 30*time.Second)
	first := mustAcquire(t, l, "slow-grant", time.Minute)
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// Another transaction holds the (free) row, so the grant's UPDATE waits.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, "SELECT 1 FROM pgfence.locks WHERE name = 'slow-grant' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	const ttl = 100 * time.Millisecond
	res := make(chan error, 1)
	go func() {
		lease, err := l.TryAcquire(ctx, "slow-grant", ttl)
		if lease != nil {
			err = errors.New("got a lease")
		}
		res <- err
	}()
	// Wait until the grant is blocked on the row lock, then let more than
	// the TTL pass (the passing of time is the condition under test).
	for {
		var waiting bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%GrantLock%')`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(ttl + 50*time.Millisecond)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	err = <-res
	var slow *pgfence.Error
	if !errors.Is(err, pgfence.ErrSlowGrant) || !pgfence.IsRetryable(err) || !errors.As(err, &slow) {
		t.Fatalf("TryAcquire after a stall longer than the TTL = %v, want a retryable *pgfence.Error matching ErrSlowGrant", err)
	}
	if slow.Token != first.Token()+1 || slow.Op != "pglock.TryAcquire" || slow.Name != "slow-grant" ||
		!strings.Contains(slow.Reason, "not within its TTL 100ms; it was released") {
		t.Errorf("slow grant error = %+v, want token %d, not within its TTL %v", slow, first.Token()+1, ttl)
	}
	info, err := Inspect(ctx, pool, "slow-grant")
	if err != nil {
		t.Fatal(err)
	}
	if info.Held || info.Token != slow.Token {
		t.Errorf("after the slow grant: %+v, want free with token %d (given back)", info, slow.Token)
	}
	next := mustAcquire(t, l, "slow-grant", time.Minute)
	if next.Token() <= slow.Token {
		t.Errorf("next grant token %d, want > %d", next.Token(), slow.Token)
	}
}

// A pooled connection whose backend was terminated since its last use (a
// failover, an idle-session kill, a DBA's pg_terminate_backend) does not
// fail the next grant, renewal or release: the statement is sent again on a
// new connection. The pool's own health check only covers connections idle
// for over a second.
func TestRetriesOnTerminatedConnection(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	dsn := pgtest.DSN(t)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	const app = "pglock-terminated"
	cfg.MaxConns = 1
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	admin := pgtest.PoolFor(t, dsn)
	// kill ends the pool's only backend and waits until it is gone.
	kill := func() {
		t.Helper()
		if n := pgtest.TerminateBackends(t, ctx, admin, app); n != 1 {
			t.Fatalf("terminated %d backends, want the pool's one", n)
		}
	}
	l := newLocker(t, pool, &Config{Holder: "survivor", PollOnly: true})
	for round := range 3 {
		name := "terminated-" + string(rune('a'+round))
		warm := mustAcquire(t, l, name, time.Minute)
		if err := warm.Release(ctx); err != nil {
			t.Fatal(err)
		}
		kill()
		lease, err := l.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatalf("round %d: TryAcquire after its connection was terminated = %v, want a lease", round, err)
		}
		if lease.Token() != warm.Token()+1 {
			t.Errorf("round %d: token %d, want %d (one grant, not two)", round, lease.Token(), warm.Token()+1)
		}
		kill()
		if err := lease.Renew(ctx); err != nil {
			t.Fatalf("round %d: Renew after its connection was terminated = %v", round, err)
		}
		kill()
		if err := lease.Release(ctx); err != nil {
			t.Fatalf("round %d: Release after its connection was terminated = %v", round, err)
		}
		if info, err := Inspect(ctx, admin, name); err != nil || info.Held || info.Token != lease.Token() {
			t.Errorf("round %d: after release %+v, %v; want free with token %d", round, info, err, lease.Token())
		}
	}
}

// Adopt turns a grant under this Locker's key that it has no Lease for (an
// earlier run's with the same Config.Key, or an unknown outcome found with
// Inspect) into a Lease, only while the grant is still held with that key,
// and never changes the token. The holder's name alone adopts nothing.
func TestAdopt(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 30*time.Second)
	earlier := newLocker(t, pool, &Config{Holder: "adopter"})
	orphan := mustAcquire(t, earlier, "adopt", time.Minute)
	_ = earlier.Close() // the Lease ends locally; the grant stays in the row

	l := newLocker(t, pool, &Config{Holder: "adopter", Key: orphan.Key(), KeepAlive: true})
	other := newLocker(t, pool, &Config{Holder: "someone-else"})
	sameName := newLocker(t, pool, &Config{Holder: "adopter"}) // another key

	// Bad input and wrong grants: typed errors, the row unchanged.
	before := rowJSON(t, pool, "adopt")
	for _, c := range []struct {
		name  string
		token int64
		ttl   time.Duration
		want  error
		arg   string // the argument an ErrInvalid names
	}{
		{"", orphan.Token(), time.Second, pgfence.ErrInvalid, "lock name"},
		{"adopt", 0, time.Second, pgfence.ErrInvalid, "token"},
		{"adopt", -1, time.Second, pgfence.ErrInvalid, "token"},
		{"adopt", orphan.Token(), 0, pgfence.ErrInvalid, "lease duration"},
		{"adopt", orphan.Token() + 1, time.Second, pgfence.ErrLost, ""}, // a token never granted
		{"never-granted", 1, time.Second, pgfence.ErrLost, ""},
	} {
		if s, err := l.Adopt(ctx, c.name, c.token, c.ttl); !errors.Is(err, c.want) || (c.arg != "" && !isInvalid(err, c.arg)) || s != nil {
			t.Errorf("Adopt(%q, %d, %v) = %v, %v; want %v", c.name, c.token, c.ttl, s, err, c.want)
		}
	}
	if _, err := other.Adopt(ctx, "adopt", orphan.Token(), time.Second); !errors.Is(err, pgfence.ErrLost) {
		t.Errorf("another holder's Adopt = %v, want pgfence.ErrLost", err)
	}
	if _, err := sameName.Adopt(ctx, "adopt", orphan.Token(), time.Second); !errors.Is(err, pgfence.ErrLost) {
		t.Errorf("Adopt by the same holder name with another key = %v, want pgfence.ErrLost", err)
	}
	if after := rowJSON(t, pool, "adopt"); after != before {
		t.Errorf("refused adoptions changed the row:\n%s\n%s", before, after)
	}

	// The real grant: adopted with a short TTL that keep-alive extends
	// (1.5 s: renewals every 0.5 s keep it even when a loaded machine delays
	// one by a second).
	const ttl = 1500 * time.Millisecond
	lease, err := l.Adopt(ctx, "adopt", orphan.Token(), ttl)
	if err != nil {
		t.Fatal(err)
	}
	if lease.Token() != orphan.Token() || lease.Holder() != "adopter" || lease.TTL() != ttl {
		t.Fatalf("adopted lease %q %d %v", lease.Holder(), lease.Token(), lease.TTL())
	}
	if d := time.Until(lease.Deadline()); d > ttl || d <= 0 {
		t.Errorf("adopted lease deadline in %v, want within the new TTL %v", d, ttl)
	}
	if _, err := l.Adopt(ctx, "adopt", orphan.Token(), ttl); !isInvalid(err, "token") {
		t.Errorf("adopting a grant twice = %v, want ErrInvalid (token)", err)
	}
	// Three TTLs later keep-alive still holds it.
	time.Sleep(3 * ttl)
	if err := lease.Err(); err != nil {
		t.Fatalf("adopted lease ended: %v", err)
	}
	if _, err := other.TryAcquire(ctx, "adopt", time.Minute); !errors.Is(err, pgfence.ErrLocked) {
		t.Errorf("another holder got the adopted lock: %v", err)
	}
	if info := inspect(t, pool, "adopt"); info.Token != orphan.Token() || !info.Held {
		t.Errorf("after adoption the row is %+v, want held with token %d", info, orphan.Token())
	}
	if err := lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Adopt(ctx, "adopt", orphan.Token(), ttl); !errors.Is(err, pgfence.ErrLost) {
		t.Errorf("adopting a released grant = %v, want pgfence.ErrLost", err)
	}
	_ = l.Close()
	if _, err := l.Adopt(ctx, "adopt", orphan.Token(), ttl); !errors.Is(err, pgfence.ErrClosed) {
		t.Errorf("Adopt on a closed Locker = %v, want pgfence.ErrClosed", err)
	}
}
