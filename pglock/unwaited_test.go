package pglock

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// ReleaseUnwaitedLock releases only where ReleaseLock would hand nothing
// over, delete nothing and notify nobody, and then leaves the same row;
// everywhere else it refuses and changes nothing.
func TestReleaseUnwaitedLock(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	ctx := testCtx(t, time.Minute)
	q := dbsqlc.New()
	for i, c := range []struct {
		name     string
		setup    fpSetup
		holder   string
		token    int64 // 0 = the current token
		releases bool
	}{
		{"held", fpHeld, "other", 0, true},
		{"mark older than 100 s", fpOldMark, "other", 0, true},
		{"wrong token", fpHeld, "other", 2, false},
		{"wrong holder", fpHeld, "me", 0, false},
		{"expired", fpExpired, "other", 0, false},
		{"free", fpFree, "other", 0, false},
		{"queued waiter", fpQueued, "other", 0, false},
		{"queue row of an ended wait", fpGrantedRow, "other", 0, true},
		{"dead queue row of an ended wait", fpDeadEndedRow, "other", 0, false},
		{"recent mark", fpMarked, "other", 0, false},
		{"SQL-looking holder", fpHeld, "other' OR true --", 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			unw, full := fmt.Sprintf("unw-%d", i), fmt.Sprintf("unw-full-%d", i)
			c.setup(t, pool, unw, int64(5000+2*i))
			c.setup(t, pool, full, int64(5001+2*i))
			token := func(name string) int64 {
				if c.token != 0 {
					return c.token
				}
				var tok int64
				if err := pool.QueryRow(ctx, "SELECT token FROM pgfence.locks WHERE name = $1", name).Scan(&tok); err != nil {
					t.Fatal(err)
				}
				return tok
			}
			before := fpState(t, pool, unw)
			got, err := q.ReleaseUnwaitedLock(ctx, pool, dbsqlc.ReleaseUnwaitedLockParams{Name: unw, Holder: c.holder, Token: token(unw)})
			after := fpState(t, pool, unw)
			if !c.releases {
				if !errors.Is(err, pgx.ErrNoRows) {
					t.Fatalf("ReleaseUnwaitedLock = %d, %v; want no row", got, err)
				}
				if after != before {
					t.Fatalf("a refused release changed the rows:\nbefore %s\nafter  %s", before, after)
				}
				return
			}
			if err != nil || got != token(unw) {
				t.Fatalf("ReleaseUnwaitedLock = %d, %v; want the token", got, err)
			}
			r, err := q.ReleaseLock(ctx, pool, dbsqlc.ReleaseLockParams{Name: full, Holder: c.holder, Token: token(full)})
			if err != nil || r.HandedOff || r.Notified {
				t.Fatalf("ReleaseLock on the same state = %+v, %v; want a plain release", r, err)
			}
			if want := fpState(t, pool, full); after != want {
				t.Fatalf("rows after ReleaseUnwaitedLock differ from ReleaseLock's:\nunwaited %s\nfull     %s", after, want)
			}
		})
	}
}

// preparedFast lists the fast-path statements prepared on conn's session.
func preparedFast(t testing.TB, conn *pgxpool.Conn) string {
	t.Helper()
	rows, err := conn.Query(context.Background(), "SELECT name FROM pg_prepared_statements WHERE name LIKE 'pgfence_fast_%' ORDER BY name")
	if err != nil {
		t.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for _, n := range names {
		kinds = append(kinds, strings.Split(strings.TrimPrefix(n, "pgfence_fast_"), "_")[0])
	}
	return strings.Join(kinds, ",")
}

// An uncontended release is the one plain UPDATE; a release with a waiter
// queued runs ReleaseLock after it and hands the lease over; a Locker whose
// Acquire of the name waited goes straight to ReleaseLock.
func TestReleaseStatements(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, time.Minute)
	dsn := pgtest.DSN(t)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1 // every statement of the releasing Locker on one session
	one, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(one.Close)
	pool := pgtest.PoolFor(t, dsn)
	l := newLocker(t, one, &Config{Holder: "releaser", PollOnly: true})
	const name = "release-statements"

	lease := mustAcquire(t, l, name, time.Minute)
	if err := lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
	conn, err := one.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := preparedFast(t, conn); got != "grant,unwaited" {
		t.Errorf("uncontended acquire+release prepared %q, want grant,unwaited (no ReleaseLock)", got)
	}
	conn.Release()

	// A waiter queues (another pool, LISTEN mode): the plain UPDATE refuses
	// and ReleaseLock hands the lease to it.
	lease = mustAcquire(t, l, name, time.Minute)
	w := newLocker(t, pool, &Config{Holder: "waiter"})
	got := handOver(t, ctx, lease, w, name, time.Minute)
	var handed int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgfence.lock_queue WHERE name = $1 AND granted_token = $2", name, got.Token()).Scan(&handed); err != nil {
		t.Fatal(err)
	}
	if handed != 1 {
		t.Fatalf("the waiter's lease was not handed over by the release (%d queue rows with its token)", handed)
	}
	conn, err = one.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := preparedFast(t, conn); got != "grant,release,unwaited" {
		t.Errorf("after a contended release: prepared %q, want grant,release,unwaited", got)
	}
	conn.Release()
	if !l.isHot(name) {
		t.Errorf("a release that handed the lease over did not mark the name hot")
	}
	if err := got.Release(ctx); err != nil {
		t.Fatal(err)
	}
}
