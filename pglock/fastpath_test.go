package pglock

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// The statements the fast path learned are the generated methods' own: a
// second recording gives the same SQL and arguments, and every field is in
// its place.
func TestFastPathRecordsGeneratedStatements(t *testing.T) {
	st := fastStmts()
	if st.grant == nil || st.release == nil {
		t.Fatalf("fast path is off: grant %v, release %v", st.grant, st.release)
	}
	var rec recordingDBTX
	_, _ = dbsqlc.New().GrantLock(context.Background(), &rec, dbsqlc.GrantLockParams{Name: "n", Holder: "h", TtlUs: 7, Key: fpOtherKey})
	if rec.sql != st.grant.sql {
		t.Errorf("grant SQL differs from the generated method's:\n%s\n---\n%s", st.grant.sql, rec.sql)
	}
	checkArgs(t, "grant", st.grant, rec.args, [fastMaxParams]fastParam{grantHolder: {text: "h"}, grantTtlUs: {int: 7}, grantName: {text: "n"}, grantKey: {bytes: fpOtherKey}})

	rec = recordingDBTX{}
	_, _ = dbsqlc.New().ReleaseLock(context.Background(), &rec, dbsqlc.ReleaseLockParams{Name: "n", Token: 9, Key: fpOtherKey})
	if rec.sql != st.release.sql {
		t.Errorf("release SQL differs from the generated method's:\n%s\n---\n%s", st.release.sql, rec.sql)
	}
	checkArgs(t, "release", st.release, rec.args, [fastMaxParams]fastParam{releaseName: {text: "n"}, releaseToken: {int: 9}, releaseKey: {bytes: fpOtherKey}})

	if st.grant.name == st.release.name || !strings.HasPrefix(st.grant.name, "pgfence_fast_grant_") {
		t.Errorf("statement names %q, %q", st.grant.name, st.release.name)
	}
}

// checkArgs checks that the fast path sends, position by position, the
// arguments the generated method sent (args) for the fields p.
func checkArgs(t *testing.T, what string, st *fastStmt, args []any, p [fastMaxParams]fastParam) {
	t.Helper()
	if len(args) != st.nparams {
		t.Fatalf("%s: generated method sends %d arguments, fast path %d", what, len(args), st.nparams)
	}
	for pos, a := range args {
		f := p[st.fieldAt[pos]]
		var want any = f.text
		switch st.paramOIDs[pos] {
		case oidInt8:
			want = f.int
		case oidBytea:
			want = f.bytes
		}
		if sentinelOf(a) != sentinelOf(want) {
			t.Errorf("%s: $%d = %#v from the generated method, %#v from the fast path", what, pos+1, a, want)
		}
	}
}

// Anything unexpected in the recording turns the fast path off.
func TestFastPathRecordRefusesSurprises(t *testing.T) {
	sent := map[string]int{sentinelOf(sentinelHolder): 0, sentinelOf(sentinelInt): 1, sentinelOf(sentinelName): 2}
	for _, c := range []struct {
		name string
		call func(dbsqlc.DBTX) error
	}{
		{"two statements", func(db dbsqlc.DBTX) error {
			db.QueryRow(context.Background(), "SELECT 1", sentinelHolder, sentinelInt, sentinelName)
			return db.QueryRow(context.Background(), "SELECT 2", sentinelHolder, sentinelInt, sentinelName).Scan()
		}},
		{"Exec", func(db dbsqlc.DBTX) error {
			_, err := db.Exec(context.Background(), "SELECT 1", sentinelHolder, sentinelInt, sentinelName)
			return err
		}},
		{"too few arguments", func(db dbsqlc.DBTX) error {
			return db.QueryRow(context.Background(), "SELECT 1", sentinelHolder, sentinelInt).Scan()
		}},
		{"a field twice", func(db dbsqlc.DBTX) error {
			return db.QueryRow(context.Background(), "SELECT 1", sentinelHolder, sentinelInt, sentinelHolder).Scan()
		}},
		{"unknown value", func(db dbsqlc.DBTX) error {
			return db.QueryRow(context.Background(), "SELECT 1", sentinelHolder, sentinelInt, "x").Scan()
		}},
		{"unknown type", func(db dbsqlc.DBTX) error {
			return db.QueryRow(context.Background(), "SELECT 1", sentinelHolder, sentinelInt, int32(1)).Scan()
		}},
		{"same value, another type", func(db dbsqlc.DBTX) error {
			return db.QueryRow(context.Background(), "SELECT 1", sentinelHolder, sentinelInt, []byte(sentinelName)).Scan()
		}},
		{"no scan", func(db dbsqlc.DBTX) error {
			db.QueryRow(context.Background(), "SELECT 1", sentinelHolder, sentinelInt, sentinelName)
			return nil
		}},
	} {
		if st := recordStmt("x", []uint32{oidInt8}, c.call, sent); st != nil {
			t.Errorf("%s: recorded %+v, want the fast path off", c.name, st)
		}
	}
	ok := recordStmt("x", []uint32{oidInt8}, func(db dbsqlc.DBTX) error {
		return db.QueryRow(context.Background(), "SELECT 1", sentinelName, sentinelHolder, sentinelInt).Scan()
	}, sent)
	if ok == nil || ok.fieldAt != [fastMaxParams]int{2, 0, 1} || ok.paramOIDs != [fastMaxParams]uint32{oidText, oidText, oidInt8} {
		t.Fatalf("recorded %+v", ok)
	}
}

// fpImpl is one implementation of the two statements.
type fpImpl struct {
	name    string
	grant   func(context.Context, *pgxpool.Conn, dbsqlc.GrantLockParams) (fastGrantRow, error)
	release func(context.Context, *pgxpool.Conn, dbsqlc.ReleaseLockParams) (fastReleaseRow, error)
}

var fpImpls = []fpImpl{
	{"fast", fastGrantLock, fastReleaseLock},
	{"generated", slowGrantLock, func(ctx context.Context, conn *pgxpool.Conn, arg dbsqlc.ReleaseLockParams) (fastReleaseRow, error) {
		r, err := dbsqlc.New().ReleaseLock(ctx, conn, arg)
		return fastReleaseRow{Released: r.Released.Bool, HandedOff: r.HandedOff.Bool, Notified: r.Notified.Bool}, err
	}},
}

// The lease keys of the tests' holders "other" (fpHeld) and "me".
var (
	fpOtherKey = []byte("other's lease key")
	fpMeKey    = []byte("my own lease key")
)

// fpState returns the lock row and queue rows of name without what differs
// between two runs on two names at two moments (name, wkey, ticket, absolute
// times).
func fpState(t testing.TB, db pgfence.DBTX, name string) string {
	t.Helper()
	var s string
	err := db.QueryRow(context.Background(), `SELECT coalesce((
		SELECT format('token=%s holder=%s acquired=%s renewed=%s ttl=%s waiting=%s live=%s',
		              token, holder, acquired_at IS NOT NULL, renewed_at IS NOT NULL,
		              expires_at - acquired_at, waiting_since IS NOT NULL, expires_at > now())
		FROM pgfence.locks WHERE name = $1), 'no row') || ' queue=' || coalesce((
		SELECT string_agg(format('%s/%s/%s', holder, ttl_us, granted_token), ',' ORDER BY ticket)
		FROM pgfence.lock_queue WHERE name = $1), '')`, name).Scan(&s)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func fpExec(t testing.TB, db pgfence.DBTX, sql string, args ...any) {
	t.Helper()
	if _, err := db.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// fpSetup puts the lock name into a state (held by "other" with token 1 and
// more, see the cases).
type fpSetup func(t testing.TB, db pgfence.DBTX, name string, wkey int64)

func fpHeld(t testing.TB, db pgfence.DBTX, name string, _ int64) {
	t.Helper()
	r, err := dbsqlc.New().GrantLock(context.Background(), db, dbsqlc.GrantLockParams{Name: name, Holder: "other", TtlUs: 60e6, Key: fpOtherKey})
	if err != nil || r.Token.Int64 != 1 {
		t.Fatalf("first grant of %s: %+v, %v", name, r, err)
	}
}

func fpFree(t testing.TB, db pgfence.DBTX, name string, wkey int64) {
	t.Helper()
	fpHeld(t, db, name, wkey)
	if r, err := dbsqlc.New().ReleaseLock(context.Background(), db, dbsqlc.ReleaseLockParams{Name: name, Token: 1, Key: fpOtherKey}); err != nil || !r.Released.Bool {
		t.Fatalf("release of %s: %+v, %v", name, r, err)
	}
}

func fpExpired(t testing.TB, db pgfence.DBTX, name string, wkey int64) {
	t.Helper()
	fpHeld(t, db, name, wkey)
	fpExec(t, db, `UPDATE pgfence.locks SET acquired_at = now() - interval '2 minutes',
		expires_at = now() - interval '1 minute' WHERE name = $1`, name)
}

func fpQueued(t testing.TB, db pgfence.DBTX, name string, wkey int64) {
	t.Helper()
	fpHeld(t, db, name, wkey)
	fpExec(t, db, `INSERT INTO pgfence.lock_queue (wkey, name, holder, key_hash, ttl_us, alive_until)
		VALUES ($1, $2, 'waiter', sha256('waiter''s key'), 30000000, now() + interval '1 minute')`, wkey, name)
}

func fpMarked(t testing.TB, db pgfence.DBTX, name string, wkey int64) {
	t.Helper()
	fpHeld(t, db, name, wkey)
	fpExec(t, db, `UPDATE pgfence.locks SET waiting_since = now() WHERE name = $1`, name)
}

// fpOldMark: held, and a waiter marked the row long ago (it has gone).
func fpOldMark(t testing.TB, db pgfence.DBTX, name string, wkey int64) {
	t.Helper()
	fpHeld(t, db, name, wkey)
	fpExec(t, db, `UPDATE pgfence.locks SET waiting_since = now() - interval '101 seconds' WHERE name = $1`, name)
}

// fpGrantedRow: held, with the queue row of a wait a release already
// handed a lease to (kept for its Locker's next wait).
func fpGrantedRow(t testing.TB, db pgfence.DBTX, name string, wkey int64) {
	t.Helper()
	fpHeld(t, db, name, wkey)
	fpExec(t, db, `INSERT INTO pgfence.lock_queue (wkey, name, holder, key_hash, ttl_us, alive_until, granted_token)
		VALUES ($1, $2, 'waiter', sha256('waiter''s key'), 30000000, now() + interval '1 minute', 1)`, wkey, name)
}

// fpDeadEndedRow: held, with the queue row of a wait that ended without a
// handoff (granted_token 0) and whose alive_until has passed (deleted by the
// next ReleaseLock of the name).
func fpDeadEndedRow(t testing.TB, db pgfence.DBTX, name string, wkey int64) {
	t.Helper()
	fpHeld(t, db, name, wkey)
	fpExec(t, db, `INSERT INTO pgfence.lock_queue (wkey, name, holder, key_hash, ttl_us, alive_until, granted_token)
		VALUES ($1, $2, 'waiter', sha256('waiter''s key'), 30000000, now() - interval '1 second', 0)`, wkey, name)
}

func fpOverflow(t testing.TB, db pgfence.DBTX, name string, wkey int64) {
	t.Helper()
	fpFree(t, db, name, wkey)
	fpExec(t, db, `UPDATE pgfence.locks SET token = 9223372036854775807 WHERE name = $1`, name)
}

func fpNone(testing.TB, pgfence.DBTX, string, int64) {}

// The fast functions and the generated methods give the same results and
// errors and leave the same rows, case by case (each run on its own name).
func TestFastPathMatchesGenerated(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	ctx := testCtx(t, time.Minute)
	type op struct {
		release bool
		holder  string
		key     []byte // nil: fpMeKey for a grant, fpOtherKey for a release
		token   int64  // release; 0 = the current token
		ttlUs   int64  // grant; 0 = 60 s
	}
	for i, c := range []struct {
		name  string
		setup fpSetup
		op    op
	}{
		{"grant free", fpFree, op{holder: "me"}},
		{"grant held", fpHeld, op{holder: "me"}},
		{"grant expired", fpExpired, op{holder: "me"}},
		{"grant no row", fpNone, op{holder: "me"}},
		{"grant token overflow", fpOverflow, op{holder: "me"}},
		{"grant holder too long", fpFree, op{holder: strings.Repeat("h", 513)}},
		{"grant empty holder", fpFree, op{holder: ""}},
		{"grant holder beyond the kept buffer", fpFree, op{holder: strings.Repeat("h", 3000)}},
		{"grant after a long holder", fpFree, op{holder: "me"}},
		{"grant short key", fpFree, op{holder: "me", key: []byte("short")}},
		{"grant TTL too long", fpFree, op{holder: "me", ttlUs: 86400000001}},
		{"release", fpHeld, op{release: true}},
		{"release wrong token", fpHeld, op{release: true, token: 2}},
		{"release wrong key", fpHeld, op{release: true, key: fpMeKey}},
		{"release expired", fpExpired, op{release: true}},
		{"release free", fpFree, op{release: true}},
		{"release handoff", fpQueued, op{release: true}},
		{"release marked", fpMarked, op{release: true}},
		{"release old mark", fpOldMark, op{release: true}},
		{"release granted row", fpGrantedRow, op{release: true}},
		{"release dead ended row", fpDeadEndedRow, op{release: true}},
		{"release queued, wrong key", fpQueued, op{release: true, key: fpMeKey}},
		{"release key too long", fpHeld, op{release: true, key: make([]byte, 65)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var results, states []string
			for j, impl := range fpImpls {
				name := fmt.Sprintf("fp-%d-%s", i, impl.name)
				c.setup(t, pool, name, int64(1000*i+j+1))
				conn, err := pool.Acquire(ctx)
				if err != nil {
					t.Fatal(err)
				}
				var res string
				if c.op.release {
					token, key := c.op.token, c.op.key
					if token == 0 {
						_ = pool.QueryRow(ctx, "SELECT token FROM pgfence.locks WHERE name = $1", name).Scan(&token)
					}
					if key == nil {
						key = fpOtherKey
					}
					var r fastReleaseRow
					r, err = impl.release(ctx, conn, dbsqlc.ReleaseLockParams{Name: name, Token: token, Key: key})
					res = fmt.Sprintf("%+v", r)
				} else {
					key, ttl := c.op.key, c.op.ttlUs
					if key == nil {
						key = fpMeKey
					}
					if ttl == 0 {
						ttl = 60e6
					}
					var r fastGrantRow
					r, err = impl.grant(ctx, conn, dbsqlc.GrantLockParams{Name: name, Holder: c.op.holder, TtlUs: ttl, Key: key})
					var exp *time.Time
					_ = conn.QueryRow(ctx, "SELECT expires_at FROM pgfence.locks WHERE name = $1", name).Scan(&exp)
					switch {
					case r.HasExpiry && (exp == nil || !r.ExpiresAt.Equal(*exp) || r.ExpiresAt.Location() != exp.Location()):
						t.Errorf("%s: expiry %v, the row's %v", impl.name, r.ExpiresAt, exp)
					case !r.HasExpiry && r.ExpiresAt != (time.Time{}):
						t.Errorf("%s: expiry %v without HasExpiry", impl.name, r.ExpiresAt)
					case err == nil && r.DbNow.IsZero():
						t.Errorf("%s: no database time", impl.name)
					}
					res = fmt.Sprintf("token=%d expiry=%v held_by=%q/%v", r.Token, r.HasExpiry, r.HeldBy, r.HasHolder)
				}
				conn.Release()
				res += " err=" + fpErr(err)
				results = append(results, res)
				states = append(states, fpState(t, pool, name))
			}
			t.Logf("%s: %s; %s", c.name, results[0], states[0])
			if results[0] != results[1] {
				t.Errorf("results differ:\nfast:      %s\ngenerated: %s", results[0], results[1])
			}
			if states[0] != states[1] {
				t.Errorf("rows differ:\nfast:      %s\ngenerated: %s", states[0], states[1])
			}
		})
	}
}

// fpErr describes an error by what callers look at: ErrNoRows, or the type
// and SQLSTATE.
func fpErr(err error) string {
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		return "nil"
	case errors.Is(err, pgx.ErrNoRows):
		return "ErrNoRows"
	case errors.As(err, &pgErr):
		return fmt.Sprintf("%T(%s %s)", err, pgErr.Code, pgErr.ConstraintName)
	}
	return fmt.Sprintf("%T(%v)", err, err)
}

// The fast path is actually taken on a default pool: the named statements
// are prepared on the connection. A pool that does not use cached prepared
// statements (here the simple protocol) gets the generated methods.
func TestFastPathTakenOnlyWithCachedStatements(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	dsn := pgtest.DSN(t)
	for _, c := range []struct {
		mode string
		fast bool
	}{
		{"", true},
		{"simple_protocol", false},
		{"exec", false},
		{"cache_describe", false},
	} {
		d := dsn
		if c.mode != "" {
			d += "&default_query_exec_mode=" + c.mode
		}
		pool := pgtest.PoolFor(t, d)
		name := "fp-taken-" + c.mode
		fpFree(t, pool, name, 0)
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		r, err := fastGrantLock(ctx, conn, dbsqlc.GrantLockParams{Name: name, Holder: "me", TtlUs: 60e6, Key: fpMeKey})
		if err != nil || r.Token != 2 || !r.HasExpiry {
			t.Fatalf("mode %q: grant %+v, %v", c.mode, r, err)
		}
		if rr, err := fastReleaseLock(ctx, conn, dbsqlc.ReleaseLockParams{Name: name, Token: 2, Key: fpMeKey}); err != nil || !rr.Released {
			t.Fatalf("mode %q: release %+v, %v", c.mode, rr, err)
		}
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'pgfence_fast_%'").Scan(&n); err != nil {
			t.Fatal(err)
		}
		conn.Release()
		if want := map[bool]int{true: 2, false: 0}[c.fast]; n != want {
			t.Errorf("mode %q: %d fast-path statements prepared, want %d", c.mode, n, want)
		}
	}
}

// A statement dropped behind pgx's back (DEALLOCATE ALL) is an error once,
// then prepared again.
func TestFastPathStatementDropped(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	fpFree(t, pool, "fp-dropped", 0)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	args := dbsqlc.ReleaseLockParams{Name: "fp-dropped", Token: 1, Key: fpMeKey}
	if r, err := fastReleaseLock(ctx, conn, args); err != nil || r.Released {
		t.Fatal(r, err)
	}
	if _, err := conn.Conn().PgConn().Exec(ctx, "DEALLOCATE ALL").ReadAll(); err != nil {
		t.Fatal(err)
	}
	_, err = fastReleaseLock(ctx, conn, args)
	if code := pgerr.Code(err); code != "26000" {
		t.Fatalf("after DEALLOCATE ALL: %v, want SQLSTATE 26000", err)
	}
	if r, err := fastReleaseLock(ctx, conn, args); err != nil || r.Released {
		t.Fatalf("next call: %+v, %v, want not released", r, err)
	}
}

// A cancelled context ends the call with context.Canceled, before or while
// the statement waits, as pgx does; the connection is not handed out again
// broken.
func TestFastPathContextCancel(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn+"&pool_max_conns=2")
	admin := pgtest.PoolFor(t, dsn)
	for _, impl := range fpImpls {
		name := "fp-cancel-" + impl.name
		fpFree(t, admin, name, 0)

		// Already cancelled: nothing is sent.
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		done, cancel := context.WithCancel(ctx)
		cancel()
		_, err = impl.grant(done, conn, dbsqlc.GrantLockParams{Name: name, Holder: "me", TtlUs: 60e6, Key: fpMeKey})
		if !errors.Is(err, context.Canceled) {
			t.Errorf("%s: cancelled context: %v", impl.name, err)
		}
		conn.Release()

		// Cancelled while the statement waits for a row lock.
		tx, err := admin.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT 1 FROM pgfence.locks WHERE name = $1 FOR UPDATE", name); err != nil {
			t.Fatal(err)
		}
		conn, err = pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithCancel(ctx)
		time.AfterFunc(200*time.Millisecond, cancel)
		start := time.Now()
		_, err = impl.grant(wctx, conn, dbsqlc.GrantLockParams{Name: name, Holder: "me", TtlUs: 60e6, Key: fpMeKey})
		if !errors.Is(err, context.Canceled) || time.Since(start) > 5*time.Second {
			t.Errorf("%s: cancelled while waiting: %v after %v", impl.name, err, time.Since(start))
		}
		closed := conn.Conn().IsClosed()
		conn.Release()
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: connection closed after the cancel: %v", impl.name, closed)

		// Every connection the pool hands out next works. (On another name:
		// the cancelled statement's backend may still apply its grant once
		// the row lock is free; pgx does not cancel it on the server.)
		other := name + "-after"
		fpFree(t, admin, other, 0)
		for range 3 {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			r, err := impl.grant(ctx, conn, dbsqlc.GrantLockParams{Name: other, Holder: "me", TtlUs: 60e6, Key: fpMeKey})
			if err == nil {
				_, err = impl.release(ctx, conn, dbsqlc.ReleaseLockParams{Name: other, Token: r.Token, Key: fpMeKey})
			}
			conn.Release()
			if err != nil {
				t.Fatalf("%s: after the cancel: %v", impl.name, err)
			}
		}
	}
}

// A connection whose backend was terminated fails the same way on both
// paths, and deadConnection (the grant's retry) recognises it.
func TestFastPathDeadConnection(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	var got []string
	for _, impl := range fpImpls {
		app := "fp-dead-" + impl.name
		pool := pgtest.PoolFor(t, dsn+"&pool_max_conns=1&application_name="+app)
		name := "fp-dead-" + impl.name
		fpFree(t, admin, name, 0)
		for _, release := range []bool{false, true} {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			// Prepare the statements first, as on a connection in use.
			_, _ = impl.release(ctx, conn, dbsqlc.ReleaseLockParams{Name: name, Token: 1, Key: fpMeKey})
			_, _ = impl.grant(ctx, conn, dbsqlc.GrantLockParams{Name: name, Holder: "x", TtlUs: 1000, Key: fpMeKey})
			if n := pgtest.TerminateBackends(t, ctx, admin, app); n != 1 {
				t.Fatalf("terminated %d backends", n)
			}
			if release {
				_, err = impl.release(ctx, conn, dbsqlc.ReleaseLockParams{Name: name, Token: 1, Key: fpMeKey})
			} else {
				_, err = impl.grant(ctx, conn, dbsqlc.GrantLockParams{Name: name, Holder: "me", TtlUs: 60e6, Key: fpMeKey})
			}
			dead := deadConnection(conn, err)
			conn.Release()
			if err == nil || !dead {
				t.Errorf("%s (release %v): %v, deadConnection %v; want a dead connection", impl.name, release, err, dead)
			}
			got = append(got, fmt.Sprintf("release=%v err=%s dead=%v", release, fpErr(err), dead))
		}
	}
	if got[0] != got[2] || got[1] != got[3] {
		t.Errorf("fast and generated differ:\n%s\n%s", strings.Join(got[:2], "\n"), strings.Join(got[2:], "\n"))
	}
}

// With context.Background (no context watching), a grant and a release on
// the fast path allocate next to nothing; the generated methods take about
// 25 allocations for the pair.
func TestFastPathAllocs(t *testing.T) { // not parallel: AllocsPerRun counts every goroutine's
	ctx := context.Background()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	fpFree(t, pool, "fp-allocs", 0)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var failed error
	cycle := func() {
		r, err := fastGrantLock(ctx, conn, dbsqlc.GrantLockParams{Name: "fp-allocs", Holder: "me", TtlUs: 60e6, Key: fpMeKey})
		if err == nil {
			var rr fastReleaseRow
			rr, err = fastReleaseLock(ctx, conn, dbsqlc.ReleaseLockParams{Name: "fp-allocs", Token: r.Token, Key: fpMeKey})
			if err == nil && !rr.Released {
				err = errors.New("not released")
			}
		}
		if err != nil && failed == nil {
			failed = err
		}
	}
	cycle() // prepares
	allocs := testing.AllocsPerRun(50, cycle)
	if failed != nil {
		t.Fatal(failed)
	}
	t.Logf("%.1f allocations per grant + release", allocs)
	if allocs > 8 { // 2 measured (two command tags); the generated calls take over 20
		t.Errorf("%.1f allocations per grant + release, want at most 8", allocs)
	}
}
