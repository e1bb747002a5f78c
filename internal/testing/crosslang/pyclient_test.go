package crosslang

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/skiplocked"
)

// runPy runs a Python script with the example client's directory as its
// first argument and args after it, and returns what it printed; a failure
// of the script fails t.
func runPy(t *testing.T, ctx context.Context, script string, args ...string) string {
	t.Helper()
	argv := append([]string{"-c", script, filepath.Dir(clientPath(t))}, args...)
	out, err := exec.CommandContext(ctx, python(t).exe, argv...).CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	return string(out)
}

// ownerDSN is the DSN of admin, the owner's (a superuser's) pool of setup.
func ownerDSN(admin *pgxpool.Pool) string { return admin.Config().ConnString() }

// rowsOf is the rows of query, each row's columns joined by "/", the rows
// by " ".
func rowsOf(t *testing.T, ctx context.Context, pool *pgxpool.Pool, query string) string {
	t.Helper()
	rows, err := pool.Query(ctx, query)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for rows.Next() {
		vals, err := rows.Values()
		if err != nil {
			t.Fatal(err)
		}
		cols := make([]string, len(vals))
		for i, v := range vals {
			cols[i] = fmt.Sprint(v)
		}
		out = append(out, strings.Join(cols, "/"))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return strings.Join(out, " ")
}

// TestPythonClaimNeedsIdleAutocommit: claim(), like acquire, refuses a
// connection that is not in autocommit mode or has a transaction open,
// before sending anything (docs/sql.md rule 1). job_claim times the claim
// from the start of its transaction, so inside a transaction begun earlier
// the claim ended before Claim.deadline (send time + TTL): another worker
// claimed the job while the first still believed it held it. On an idle
// autocommit connection the claim is taken, with a deadline within its TTL.
func TestPythonClaimNeedsIdleAutocommit(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin, roleDSN := setup(t, ctx, "SELECT 1", "SELECT 1 WHERE '%s' <> ''")
	out := runPy(t, ctx, `
import sys, time
sys.path.insert(0, sys.argv[1])
import psycopg, pgfence
dsn = sys.argv[2]
with psycopg.connect(dsn, autocommit=True) as conn:
    pgfence.enqueue(conn, "idle", [{"n": 1}])
with psycopg.connect(dsn) as conn:  # psycopg's default: autocommit off
    try:
        pgfence.claim(conn, "idle", "py", 2, 1)
        print("claim without autocommit: accepted")
    except ValueError:
        print("claim without autocommit: refused")
with psycopg.connect(dsn, autocommit=True) as conn:
    try:
        with conn.transaction():
            conn.execute("SELECT pg_sleep(0.3)")  # earlier work of the same transaction
            pgfence.claim(conn, "idle", "py", 2, 1)
        print("claim in a transaction: accepted")
    except ValueError:
        print("claim in a transaction: refused")
    (c,) = pgfence.claim(conn, "idle", "py", 2, 1)
    print("claim: ok, deadline within the TTL:", 0 < c.deadline - time.monotonic() <= 2)
`, roleDSN)
	want := "claim without autocommit: refused\nclaim in a transaction: refused\nclaim: ok, deadline within the TTL: True\n"
	if out != want {
		t.Fatalf("python printed\n%s\nwant\n%s", out, want)
	}
	// Only the last call claimed the job: the refused ones sent nothing.
	if got := rowsOf(t, ctx, admin, "SELECT state, attempts, claim_token FROM pgfence.jobs"); got != "running/1/1" {
		t.Fatalf("job after the calls: %s, want running/1/1 (claimed once)", got)
	}
}

// TestPythonFencedUpdateIgnoresSearchPathOperators: another role owns a
// schema on the application role's search_path and plants there an "="
// (varchar, varchar) that matches 'alice' to the row 'bob'. pg_catalog has
// no such exact operator, so bare SQL comparing a varchar key with a
// parameter picks the planted one (checked first, so the plant is live):
// fenced_update wrote bob's row when told alice's. The client names
// pg_catalog's operators and types, so the write lands on alice's row, the
// re-read after a refused write reports alice's fence (AlreadyApplied), and
// a stale token is refused with carol's fence. ("<" is qualified too; on a
// bigint fence pg_catalog has every exact integer operator, which the
// implicit pg_catalog search finds first, so a plant cannot win there.) The
// planting role, cluster-wide, is dropped when the test ends.
func TestPythonFencedUpdateIgnoresSearchPathOperators(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	planter := fmt.Sprintf("planter_%d_%04d", time.Now().UnixNano()%1_000_000, rand.IntN(10000))
	pid := pgx.Identifier{planter}.Sanitize()
	admin, roleDSN := setup(t, ctx, `
		CREATE TABLE accounts (code varchar(20) PRIMARY KEY, balance int NOT NULL, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO accounts VALUES ('alice', 100, 0), ('bob', 100, 0), ('carol', 100, 7)`,
		`GRANT SELECT, UPDATE ON accounts TO %s`)
	if _, err := admin.Exec(ctx, "CREATE ROLE "+pid+" NOLOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // before admin closes and the database is dropped (cleanups run last first)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, s := range []string{"DROP OWNED BY " + pid, "DROP ROLE " + pid} {
			if _, err := admin.Exec(ctx, s); err != nil {
				t.Errorf("%s: %v", s, err)
			}
		}
	})
	var role string
	if err := admin.QueryRow(ctx, "SELECT grantee FROM information_schema.role_table_grants WHERE table_name = 'accounts' AND privilege_type = 'UPDATE' AND grantee <> current_user").Scan(&role); err != nil {
		t.Fatal(err)
	}
	rid := pgx.Identifier{role}.Sanitize()
	if err := pgx.BeginFunc(ctx, admin, func(tx pgx.Tx) error {
		for _, s := range []string{
			"CREATE SCHEMA shared AUTHORIZATION " + pid,
			"GRANT USAGE ON SCHEMA shared TO " + rid,
			`ALTER ROLE ` + rid + ` SET search_path = "$user", shared, public`,
			"SET LOCAL ROLE " + pid,
			`CREATE FUNCTION shared.veq(varchar, varchar) RETURNS boolean LANGUAGE sql IMMUTABLE
				AS $$ SELECT CASE WHEN $2::text = 'alice' THEN $1::text = 'bob' ELSE $1::text = $2::text END $$`,
			"CREATE OPERATOR shared.= (LEFTARG = varchar, RIGHTARG = varchar, FUNCTION = shared.veq)",
		} {
			if _, err := tx.Exec(ctx, s); err != nil {
				return fmt.Errorf("%s: %w", s, err)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	out := runPy(t, ctx, `
import sys
sys.path.insert(0, sys.argv[1])
import psycopg, pgfence
with psycopg.connect(sys.argv[2], autocommit=True) as conn:
    print("search_path", conn.execute("SHOW search_path").fetchone()[0])
    # the planted operators decide bare SQL on this connection
    print("bare =", conn.execute("SELECT code FROM accounts WHERE code = %s", ("alice",)).fetchall())
    lease = pgfence.acquire(conn, "accounts", ttl=30, holder="w")
    pgfence.fenced_update(conn, "accounts", "code", "alice", {"balance": 0}, lease.token)
    print("write alice: ok")
    try:
        pgfence.fenced_update(conn, "accounts", "code", "carol", {"balance": 0}, lease.token)
        print("stale write carol: accepted")
    except pgfence.StaleToken as e:
        print("stale write carol:", type(e).__name__, e.fence)
    try:
        pgfence.fenced_update(conn, "accounts", "code", "alice", {"balance": 1}, lease.token)
        print("alice again: accepted")
    except pgfence.StaleToken as e:
        print("alice again:", type(e).__name__, e.fence)
    pgfence.release(conn, lease)
`, roleDSN)
	want := `search_path "$user", shared, public
bare = [('bob',)]
write alice: ok
stale write carol: StaleToken 7
alice again: AlreadyApplied 1
`
	if out != want {
		t.Fatalf("python printed\n%s\nwant\n%s", out, want)
	}
	if got := rowsOf(t, ctx, admin, "SELECT code, balance, fence FROM accounts ORDER BY code"); got != "alice/0/1 bob/100/0 carol/100/7" {
		t.Fatalf("rows: %s, want alice/0/1 bob/100/0 carol/100/7", got)
	}
}

// TestPythonLeaseInvalidAfterReleaseOrLoss: Lease.valid() turns false (the
// deadline is -inf) when the lease is released, when renew() raises
// LeaseLost, and when release() raises LeaseLost; before, it stayed true
// until the local deadline passed.
func TestPythonLeaseInvalidAfterReleaseOrLoss(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin, roleDSN := setup(t, ctx, "SELECT 1", "SELECT 1 WHERE '%s' <> ''")
	out := runPy(t, ctx, `
import sys
sys.path.insert(0, sys.argv[1])
import psycopg, pgfence
with psycopg.connect(sys.argv[2], autocommit=True) as conn, psycopg.connect(sys.argv[3], autocommit=True) as owner:
    def expire(name):  # the holder paused past its lease, on the database clock
        owner.execute("SELECT pgfence.test_expire_lease(%s)", (name,))
    lease = pgfence.acquire(conn, "valid:a", 30, "py")
    print("acquired", lease.valid())
    pgfence.release(conn, lease)
    print("released", lease.valid(), lease.remaining())
    lease = pgfence.acquire(conn, "valid:b", 30, "py")
    expire("valid:b")
    print("expired on the database, local", lease.valid())
    try:
        pgfence.renew(conn, lease)
    except pgfence.LeaseLost:
        print("renew: LeaseLost", lease.valid())
    lease = pgfence.acquire(conn, "valid:c", 30, "py")
    expire("valid:c")
    newer = pgfence.acquire(conn, "valid:c", 30, "py-2")
    try:
        pgfence.release(conn, lease)
    except pgfence.LeaseLost:
        print("release: LeaseLost", lease.valid())
    print("newer holder", newer.valid())
    pgfence.release(conn, newer)
`, roleDSN, ownerDSN(admin))
	want := `acquired True
released False -inf
expired on the database, local True
renew: LeaseLost False
release: LeaseLost False
newer holder True
`
	if out != want {
		t.Fatalf("python printed\n%s\nwant\n%s", out, want)
	}
}

// readmeDSN is the DSN the example of examples/python/README.md connects to.
const readmeDSN = "postgres://app@db/app"

// readmeExample is the first python block of examples/python/README.md, to
// connect to dsn.
func readmeExample(t *testing.T, dsn string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(filepath.Dir(clientPath(t)), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)```python\n(.*?)```").FindSubmatch(b)
	if m == nil || !strings.Contains(string(m[1]), `"`+readmeDSN+`"`) {
		t.Fatalf("examples/python/README.md has no python block connecting to %q", readmeDSN)
	}
	return strings.ReplaceAll(string(m[1]), readmeDSN, dsn)
}

// TestPythonReadmeExample runs the example of examples/python/README.md as
// written against tables invoices and sent and three jobs of queue emails:
// once as is (the write applies, the lease is released, every job is
// completed with its effect), and once with the lease taken over between
// acquire and the write (expired on the database clock, granted to
// billing-2, which writes the row): the late write raises StaleToken and
// the release LeaseLost, both handled by the example, which still drains
// the queue.
func TestPythonReadmeExample(t *testing.T) {
	for _, tc := range []struct {
		name     string
		takeover bool
		invoice  string
	}{
		{"as-is", false, "7/paid/1"},
		{"taken-over-before-the-write", true, "7/paid by billing-2/2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			admin, roleDSN := setup(t, ctx, `
				CREATE TABLE invoices (id int PRIMARY KEY, status text NOT NULL, fence bigint NOT NULL DEFAULT 0);
				INSERT INTO invoices VALUES (7, 'open', 0);
				CREATE TABLE sent (job_id bigint PRIMARY KEY)`,
				"GRANT SELECT, UPDATE ON invoices TO %s; GRANT INSERT ON sent TO %s")
			ps := make([]skiplocked.EnqueueParams, 3)
			for i := range ps {
				ps[i] = skiplocked.EnqueueParams{Queue: "emails", Payload: json.RawMessage(fmt.Sprintf(`{"n": %d}`, i))}
			}
			if _, err := skiplocked.Enqueue(ctx, admin, ps...); err != nil {
				t.Fatal(err)
			}
			takeover := "0"
			if tc.takeover {
				takeover = "1"
			}
			out := runPy(t, ctx, `
import sys
sys.path.insert(0, sys.argv[1])
import psycopg, pgfence
example, app, owner, takeover = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"
if takeover:
    write = pgfence.fenced_update
    def paused_past_the_lease(conn, table, key_column, key, values, token, **kw):
        # the holder pauses here past its lease: it expires on the database
        # clock, billing-2 takes it over and writes the row first
        with psycopg.connect(owner, autocommit=True) as o:
            o.execute("SELECT pgfence.test_expire_lease('invoices')")
        with psycopg.connect(app, autocommit=True) as b:
            newer = pgfence.acquire(b, "invoices", ttl=30, holder="billing-2")
            write(b, table, key_column, key, {"status": "paid by billing-2"}, newer.token)
        try:
            return write(conn, table, key_column, key, values, token, **kw)
        except Exception as e:
            print("late write:", type(e).__name__)
            raise
    pgfence.fenced_update = paused_past_the_lease
exec(compile(example, "README.md", "exec"), {})
print("example: ok")
`, readmeExample(t, roleDSN), roleDSN, ownerDSN(admin), takeover)
			want := "example: ok\n"
			if tc.takeover {
				want = "late write: StaleToken\n" + want
			}
			if out != want {
				t.Fatalf("python printed\n%s\nwant\n%s", out, want)
			}
			if got := rowsOf(t, ctx, admin, "SELECT id, status, fence FROM invoices"); got != tc.invoice {
				t.Errorf("invoice: %s, want %s", got, tc.invoice)
			}
			wantLock := "1/<nil>" // billing-1's token, released
			if tc.takeover {
				wantLock = "2/billing-2" // billing-2's, still held: billing-1's release was refused
			}
			if got := rowsOf(t, ctx, admin, "SELECT token, holder FROM pgfence.locks WHERE name = 'invoices'"); got != wantLock {
				t.Errorf("lock invoices: %s, want %s", got, wantLock)
			}
			if got := rowsOf(t, ctx, admin, "SELECT count(*) FILTER (WHERE j.state = 'completed'), count(s.job_id) "+
				"FROM pgfence.jobs j LEFT JOIN sent s ON s.job_id = j.id"); got != "3/3" {
				t.Errorf("jobs completed / effects: %s, want 3/3", got)
			}
		})
	}
}

// TestPythonFencedUpdateChangedConcurrently: a fenced write that changes no
// row while the row's fence, read again, is below the token raises
// ChangedConcurrently (not a StaleToken): the row changed between the
// UPDATE and the re-read, nothing was written, and the same write with the
// same token then applies. A concurrent transaction moves row 1 to key 2
// and inserts a new row 1 (fence 0); the Python UPDATE of row 1 waits for
// its lock, then finds the moved row no longer matches and cannot see the
// new one; the re-read, after the commit, sees the new row's fence 0.
func TestPythonFencedUpdateChangedConcurrently(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin, roleDSN := setup(t, ctx, `
		CREATE TABLE moves (id int PRIMARY KEY, v text NOT NULL, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO moves VALUES (1, 'seed', 0)`,
		"GRANT SELECT, UPDATE ON moves TO %s")
	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, "UPDATE moves SET id = 2 WHERE id = 1; INSERT INTO moves VALUES (1, 'recreated', 0)"); err != nil {
		t.Fatal(err)
	}
	const app = "pyclient-changed-concurrently"
	p := startProc(t, "python fenced_update", nil, python(t).exe, "-c", `
import sys
sys.path.insert(0, sys.argv[1])
import psycopg, pgfence
with psycopg.connect(sys.argv[2], autocommit=True, application_name=sys.argv[3]) as conn:
    try:
        pgfence.fenced_update(conn, "moves", "id", 1, {"v": "py"}, 5)
        print("first: applied", flush=True)
    except pgfence.ChangedConcurrently as e:
        print("first: ChangedConcurrently fence=%s stale=%s" % (e.fence, isinstance(e, pgfence.StaleToken)), flush=True)
    pgfence.fenced_update(conn, "moves", "id", 1, {"v": "py"}, 5)
    print("again: applied", flush=True)
`, filepath.Dir(clientPath(t)), roleDSN, app)
	pollUntil(t, ctx, lineWait, "the Python UPDATE waits for the row lock", func() (bool, error) {
		var waiting bool
		err := admin.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock')", app).Scan(&waiting)
		return waiting, err
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if l := p.next(lineWait); l != "first: ChangedConcurrently fence=0 stale=False" {
		t.Fatalf("first write: %q", l)
	}
	if l := p.next(lineWait); l != "again: applied" {
		t.Fatalf("the same write again: %q", l)
	}
	p.wait(lineWait)
	if got := rowsOf(t, ctx, admin, "SELECT id, v, fence FROM moves ORDER BY id"); got != "1/py/5 2/seed/0" {
		t.Fatalf("rows: %s, want 1/py/5 2/seed/0", got)
	}
}
