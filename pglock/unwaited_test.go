package pglock

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// pgfence.lock_release releases a held lease whatever the queue holds,
// handing it to a live waiter or notifying a recent mark, and refuses a
// wrong token or key, an expired or a free lease, changing nothing.
func TestReleaseLockCases(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	ctx := testCtx(t, time.Minute)
	q := dbsqlc.New()
	for i, c := range []struct {
		name   string
		setup  fpSetup
		key    []byte
		token  int64  // 0 = the current token
		result string // the release's result; "" = refused
	}{
		{"held", fpHeld, fpOtherKey, 0, "released"},
		{"mark older than 100 s", fpOldMark, fpOtherKey, 0, "released"},
		{"wrong token", fpHeld, fpOtherKey, 2, ""},
		{"wrong key", fpHeld, fpMeKey, 0, ""},
		{"expired", fpExpired, fpOtherKey, 0, ""},
		{"free", fpFree, fpOtherKey, 0, ""},
		{"queued waiter", fpQueued, fpOtherKey, 0, "released handed_off notified"},
		{"queue row of an ended wait", fpGrantedRow, fpOtherKey, 0, "released"},
		{"dead queue row of an ended wait", fpDeadEndedRow, fpOtherKey, 0, "released"},
		{"recent mark", fpMarked, fpOtherKey, 0, "released notified"},
		{"SQL-looking key", fpHeld, []byte("other' OR true --"), 0, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			name := fmt.Sprintf("rel-%d", i)
			c.setup(t, pool, name, int64(5000+i))
			token := c.token
			if token == 0 {
				if err := pool.QueryRow(ctx, "SELECT token FROM pgfence.locks WHERE name = $1", name).Scan(&token); err != nil {
					t.Fatal(err)
				}
			}
			before := fpState(t, pool, name)
			r, err := q.ReleaseLock(ctx, pool, dbsqlc.ReleaseLockParams{Name: name, Token: token, Key: c.key})
			if err != nil {
				t.Fatal(err)
			}
			after := fpState(t, pool, name)
			var got []string
			for _, f := range []struct {
				on   bool
				what string
			}{{r.Released.Bool, "released"}, {r.HandedOff.Bool, "handed_off"}, {r.Notified.Bool, "notified"}} {
				if f.on {
					got = append(got, f.what)
				}
			}
			if g := strings.Join(got, " "); g != c.result {
				t.Fatalf("release = %q, want %q (rows %s)", g, c.result, after)
			}
			if c.result == "" && after != before {
				t.Fatalf("a refused release changed the rows:\nbefore %s\nafter  %s", before, after)
			}
			if c.result == "released" && !strings.Contains(after, "holder= ") {
				t.Fatalf("released, but the row is %s", after)
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

// An acquire+release prepares the two fast-path statements (lock_grant and
// lock_release) and nothing else; a release with a waiter queued hands the
// lease over in the same call and marks the name hot.
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
	if got := preparedFast(t, conn); got != "grant,release" {
		t.Errorf("uncontended acquire+release prepared %q, want grant,release", got)
	}
	conn.Release()

	// A waiter queues (another pool, LISTEN mode): the release hands the
	// lease to it.
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
	if got := preparedFast(t, conn); got != "grant,release" {
		t.Errorf("after a contended release: prepared %q, want grant,release", got)
	}
	conn.Release()
	if !l.isHot(name) {
		t.Errorf("a release that handed the lease over did not mark the name hot")
	}
	if err := got.Release(ctx); err != nil {
		t.Fatal(err)
	}
}
