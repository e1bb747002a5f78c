package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock/advisory"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type result struct {
	stdout, stderr string
	code           int
}

// run executes the CLI in-process against dsn (via DATABASE_URL).
func run(t *testing.T, dsn string, args ...string) result {
	t.Helper()
	var out, errb bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	code := Main(ctx, args, Env{
		Stdout: &out,
		Stderr: &errb,
		Getenv: func(k string) string {
			if k == "DATABASE_URL" {
				return dsn
			}
			return ""
		},
	})
	return result{out.String(), errb.String(), code}
}

func TestMigrateCommands(t *testing.T) {
	t.Parallel()
	dsn := pgtest.EmptyDSN(t)

	r := run(t, dsn, "locks")
	if r.code != ExitNotMigrated || !strings.Contains(r.stderr, "run: pgfence migrate up") {
		t.Fatalf("locks on empty db: code %d stderr %q", r.code, r.stderr)
	}

	r = run(t, dsn, "migrate", "status", "--json")
	if r.code != 0 {
		t.Fatalf("status: %+v", r)
	}
	var st []struct {
		Version int64 `json:"version"`
		Applied bool  `json:"applied"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &st); err != nil || len(st) == 0 {
		t.Fatalf("status json %q: %v", r.stdout, err)
	}
	for _, s := range st {
		if s.Applied {
			t.Fatalf("migration %d applied before up", s.Version)
		}
	}
	latest := st[len(st)-1].Version

	r = run(t, dsn, "migrate", "up")
	if r.code != 0 || !strings.Contains(r.stdout, "applied") {
		t.Fatalf("up: %+v", r)
	}
	r = run(t, dsn, "migrate", "up")
	if r.code != 0 || !strings.Contains(r.stdout, "nothing to apply") {
		t.Fatalf("second up: %+v", r)
	}
	r = run(t, dsn, "migrate", "version", "--json")
	var v struct{ Version, Latest int64 }
	if err := json.Unmarshal([]byte(r.stdout), &v); err != nil || v.Version != latest || v.Latest != latest {
		t.Fatalf("version: %q %v", r.stdout, err)
	}
	r = run(t, dsn, "migrate", "down", "--all", "--yes")
	if r.code != 0 || !strings.Contains(r.stdout, "version 0") {
		t.Fatalf("down --all: %+v", r)
	}
	r = run(t, dsn, "locks")
	if r.code != ExitNotMigrated {
		t.Fatalf("locks after down: %+v", r)
	}
	if r = run(t, dsn, "migrate", "up"); r.code != 0 {
		t.Fatalf("up again: %+v", r)
	}
	r = run(t, dsn, "migrate", "status")
	if r.code != 0 || strings.Contains(r.stdout, "pending") || !strings.Contains(r.stdout, "applied") {
		t.Fatalf("status table: %+v", r)
	}
}

func TestBadConnection(t *testing.T) {
	t.Parallel()
	r := run(t, "postgres://nobody@127.0.0.1:1/none?sslmode=disable&connect_timeout=2", "locks")
	if r.code != ExitError || !strings.Contains(r.stderr, "cannot connect to database") || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
		t.Fatalf("bad DSN: code %d stderr %q", r.code, r.stderr)
	}
	r = run(t, "not a dsn ::: =", "locks")
	if r.code != ExitUsage {
		t.Fatalf("malformed DSN: code %d stderr %q", r.code, r.stderr)
	}
	r = run(t, "", "no-such-command")
	if r.code != ExitUsage {
		t.Fatalf("unknown command: code %d", r.code)
	}
}

func TestLocksListing(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `
		INSERT INTO pgfence.locks(name, token, holder, acquired_at, expires_at, metadata) VALUES
		  ('invoice:1', 7, 'host/1/a', now(), now() + interval '1 hour', '{"job": 42}'),
		  ('invoice:2', 3, 'host/2/b', now() - interval '2 minutes', now() - interval '1 minute', NULL),
		  ('report',    9, NULL, now() - interval '1 day', NULL, NULL)`)
	if err != nil {
		t.Fatal(err)
	}

	r := run(t, dsn, "locks")
	if r.code != 0 {
		t.Fatalf("%+v", r)
	}
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != 4 || !strings.HasPrefix(lines[0], "NAME") {
		t.Fatalf("table:\n%s", r.stdout)
	}
	for i, want := range [][]string{{"invoice:1", "held", "host/1/a", "7"}, {"invoice:2", "expired", "host/2/b", "3", "expired"}, {"report", "free", "-", "9"}} {
		f := strings.Fields(lines[i+1])
		for j, w := range want[:4] {
			if f[j] != w {
				t.Errorf("row %d field %d = %q, want %q (%s)", i, j, f[j], w, lines[i+1])
			}
		}
	}

	var views []lockView
	r = run(t, dsn, "locks", "--held", "--json")
	if err := json.Unmarshal([]byte(r.stdout), &views); err != nil {
		t.Fatal(err)
	}
	if len(views) != 1 || views[0].Name != "invoice:1" || views[0].Token != 7 || views[0].ExpiresInMS == nil ||
		*views[0].ExpiresInMS < 3500*1000 || *views[0].ExpiresInMS > 3600*1000 || !strings.Contains(string(views[0].Metadata), `"job": 42`) {
		t.Fatalf("--held --json: %s", r.stdout)
	}
	r = run(t, dsn, "locks", "--expired", "--free", "--json")
	views = nil
	if err := json.Unmarshal([]byte(r.stdout), &views); err != nil {
		t.Fatal(err)
	}
	if len(views) != 2 || views[0].State != "expired" || *views[0].ExpiresInMS >= 0 || views[1].State != "free" || views[1].ExpiresInMS != nil {
		t.Fatalf("--expired --free: %s", r.stdout)
	}
	r = run(t, dsn, "locks", "--name", "invoice:%", "--json")
	views = nil
	if err := json.Unmarshal([]byte(r.stdout), &views); err != nil || len(views) != 2 {
		t.Fatalf("--name: %s %v", r.stdout, err)
	}
	// A pattern that looks like SQL is only a pattern.
	r = run(t, dsn, "locks", "--name", "x'; DROP TABLE pgfence.locks; --", "--json")
	if r.code != 0 || strings.TrimSpace(r.stdout) != "[]" {
		t.Fatalf("sql-looking pattern: %+v", r)
	}

	r = run(t, dsn, "locks", "show", "invoice:1")
	if r.code != 0 || !strings.Contains(r.stdout, "state:") || !strings.Contains(r.stdout, "held") || !strings.Contains(r.stdout, `{"job": 42}`) {
		t.Fatalf("show: %+v", r)
	}
	r = run(t, dsn, "locks", "show", "nope")
	if r.code != ExitNotFound || !strings.Contains(r.stderr, `no lock named "nope"`) {
		t.Fatalf("show missing: %+v", r)
	}
	r = run(t, dsn, "locks", "--limit", "0")
	if r.code != ExitUsage {
		t.Fatalf("limit 0: %+v", r)
	}
}

// TestLocksLimitSaysHowManyMore: `locks --limit N` lists N locks and says
// on stderr how many more match (the state and name filters applied), with
// and without --json; a listing that is not cut says nothing. It cut the
// listing silently.
func TestLocksLimitSaysHowManyMore(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	if _, err := pool.Exec(context.Background(), `
		INSERT INTO pgfence.locks(name, token) VALUES ('l1', 1), ('l2', 1), ('l3', 1), ('l4', 1), ('other', 1);
		INSERT INTO pgfence.locks(name, token, holder, acquired_at, expires_at)
		VALUES ('l5', 2, 'h', now(), now() + interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args  []string
		shown int
		note  string
	}{
		{[]string{"locks", "--name", "l%", "--limit", "2"}, 2, "pgfence: 3 more row(s) not shown (--limit 2)\n"},
		{[]string{"locks", "--name", "l%", "--limit", "2", "--json"}, 2, "pgfence: 3 more row(s) not shown (--limit 2)\n"},
		{[]string{"locks", "--free", "--limit", "4"}, 4, "pgfence: 1 more row(s) not shown (--limit 4)\n"},
		{[]string{"locks", "--name", "l%", "--limit", "5"}, 5, ""},
		{[]string{"locks", "--held", "--limit", "1"}, 1, ""},
	} {
		r := run(t, dsn, tc.args...)
		var shown int
		if slices.Contains(tc.args, "--json") {
			var views []lockView
			if err := json.Unmarshal([]byte(r.stdout), &views); err != nil {
				t.Fatalf("pgfence %q: %v", tc.args, err)
			}
			shown = len(views)
		} else {
			shown = len(strings.Split(strings.TrimSpace(r.stdout), "\n")) - 1
		}
		if r.code != ExitOK || shown != tc.shown || r.stderr != tc.note {
			t.Errorf("pgfence %q: code %d, %d rows, stderr %q; want 0, %d rows, %q", tc.args, r.code, shown, r.stderr, tc.shown, tc.note)
		}
	}
}

func TestFences(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `
		INSERT INTO pgfence.locks(name, token) VALUES ('store:1', 5), ('store:2', 2);
		CREATE TABLE catalogue (store_id int, sku text, price int, store_lock text, fence bigint NOT NULL DEFAULT 0,
		                        PRIMARY KEY (store_id, sku));
		INSERT INTO catalogue VALUES
		  (1, 'a', 10, 'store:1', 5),  -- current
		  (1, 'b', 11, 'store:1', 4),  -- behind
		  (2, 'a', 12, 'store:2', 9),  -- forged
		  (3, 'a', 13, 'store:3', 0);  -- no lock row`)
	if err != nil {
		t.Fatal(err)
	}
	r := run(t, dsn, "fences", "--table", "public.catalogue", "--key", "store_id,sku", "--lock-column", "store_lock", "--json")
	if r.code != ExitForged {
		t.Fatalf("code %d, want %d: %+v", r.code, ExitForged, r)
	}
	var rows []fenceRow
	if err := json.Unmarshal([]byte(r.stdout), &rows); err != nil {
		t.Fatal(err)
	}
	want := []string{fenceCurrent, fenceBehind, fenceForged, fenceNoLock}
	if len(rows) != len(want) {
		t.Fatalf("rows: %s", r.stdout)
	}
	for i, w := range want {
		if rows[i].Status != w {
			t.Errorf("row %v status %s, want %s", rows[i].Key, rows[i].Status, w)
		}
	}
	r = run(t, dsn, "fences", "--table", "catalogue", "--key", "store_id,sku", "--lock", "store:1")
	if r.code != ExitForged || !strings.Contains(r.stdout, "FORGED") || !strings.Contains(r.stdout, "current") {
		t.Fatalf("--lock: %+v", r)
	}
	for _, tc := range []struct {
		args []string
		code int
	}{
		{[]string{"fences", "--table", "x; drop table catalogue", "--lock", "a"}, ExitNotFound},
		{[]string{"fences", "--table", "catalogue", "--key", "nope", "--lock", "a"}, ExitNotFound},
		{[]string{"fences", "--table", "catalogue", "--fence-column", "price", "--key", "sku", "--lock", "a"}, ExitNotFound}, // docs/cli.md: no bigint fence column is 3
		{[]string{"fences", "--table", "catalogue", "--key", "sku"}, ExitUsage},
		{[]string{"fences", "--table", "", "--lock", "a"}, ExitUsage},
		{[]string{"fences", "--table", strings.Repeat("t", 64), "--lock", "a"}, ExitUsage},
		{[]string{"fences", "--table", "a.b.c", "--lock", "a"}, ExitUsage},
	} {
		r := run(t, dsn, tc.args...)
		if r.code != tc.code {
			t.Errorf("%v: code %d, want %d (%s)", tc.args, r.code, tc.code, r.stderr)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM catalogue").Scan(&n); err != nil || n != 4 {
		t.Fatalf("catalogue changed: %d %v", n, err)
	}
}

func TestAdvisoryList(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	key, err := advisory.Name("nightly-report")
	if err != nil {
		t.Fatal(err)
	}
	k, _ := key.Int64()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", k); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(ctx, "SELECT pg_advisory_unlock($1)", k)
	var pid int32
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	r := run(t, dsn, "advisory", "list", "--name", "nightly-report", "--json")
	var rows []struct {
		Key     string `json:"key"`
		Mode    string `json:"mode"`
		Granted bool   `json:"granted"`
		PID     int32  `json:"pid"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &rows); err != nil || r.code != 0 {
		t.Fatalf("advisory list: %+v %v", r, err)
	}
	if len(rows) != 1 || rows[0].PID != pid || !rows[0].Granted || rows[0].Key != key.String() {
		t.Fatalf("advisory list = %+v, want key %s held by pid %d", rows, key, pid)
	}
	r = run(t, dsn, "advisory", "list")
	if r.code != 0 || !strings.Contains(r.stdout, key.String()) {
		t.Fatalf("table: %+v", r)
	}
}

// TestAdvisoryListRefusesEmptyName: `advisory list --name ""` (an unset
// shell variable) exits 2 and lists nothing, as `jobs --queue ""` does; it
// listed every advisory lock, an answer to another question.
func TestAdvisoryListRefusesEmptyName(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock(4242)"); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(ctx, "SELECT pg_advisory_unlock(4242)") //nolint:errcheck
	for _, args := range [][]string{
		{"advisory", "list", "--name", ""},
		{"advisory", "list", "--name", "", "--json"},
		{"advisory", "list", "--name="},
	} {
		r := run(t, dsn, args...)
		if r.code != ExitUsage || r.stdout != "" || !strings.Contains(r.stderr, "--name is empty") {
			t.Errorf("pgfence %q: code %d, stdout %q, stderr %q; want %d, nothing listed", args, r.code, r.stdout, r.stderr, ExitUsage)
		}
	}
	// Without --name every lock is listed, 4242 among them.
	if r := run(t, dsn, "advisory", "list"); r.code != ExitOK || !strings.Contains(r.stdout, "4242") {
		t.Errorf("advisory list: %+v", r)
	}
}

// TestBadInputBeforeConnecting: bad subcommands, flags and values are exit 2
// before any connection is tried (the DSN points at a closed port, so a
// command that connected first would exit 1), and nothing is changed.
func TestBadInputBeforeConnecting(t *testing.T) {
	t.Parallel()
	const closed = "postgres://nobody@127.0.0.1:1/none?sslmode=disable&connect_timeout=2"
	const key = "00112233445566778899aabbccddeeff"
	long := strings.Repeat("n", 513)
	for _, args := range [][]string{
		// A typo under a command group used to show the group's help, exit 0.
		{"migrate", "upp"},
		{"gen", "fencd"},
		{"advisory", "bogus"},
		{"jobs", "bogus"},
		{"outbox", "bogus"},
		{"completion", "nosuch"},
		// help for a command that does not exist said so and exited 0.
		{"help", "nosuch"},
		{"help", "migrate", "upp"},
		// --to with --all rolled every migration back.
		{"migrate", "down", "--to", "3", "--all"},
		{"migrate", "down", "--to", "-1"},
		// Rolling back to 0 without --yes; a version no migration has.
		{"migrate", "down", "--all"},
		{"migrate", "down", "--to", "0"},
		{"migrate", "down", "--to", "3"},
		{"advisory", "list", "--name", ""},
		{"acquire", "--lock", "x", "--ttl", "0"},
		{"acquire", "--lock", "x", "--ttl", "-1s"},
		{"acquire", "--lock", "x", "--ttl", "25h"},
		{"acquire", "--lock", long},
		{"acquire", "--lock", "a\xff"},
		{"acquire", "--lock", "a\x00b"},
		{"acquire", "--lock", "x", "--holder", long},
		{"renew", "--lock", "x", "--token", "-5", "--key", key},
		{"renew", "--lock", "x", "--token", "5", "--key", key, "--ttl", "0"},
		{"renew", "--lock", "x", "--token", "5", "--key", "ab"},
		{"renew", "--lock", long, "--token", "5", "--key", key},
		{"release", "--lock", "x", "--token", "-1", "--key", key},
		{"release", "--lock", "x", "--token", "1", "--key", strings.Repeat(key, 4) + "00"},
		{"run", "--lock", "x", "--ttl", "0", "--", "true"},
		{"run", "--lock", long, "--", "true"},
		{"fences", "--table", "a.b.c", "--key", "id", "--lock", "l"},
		{"fences", "--table", strings.Repeat("t", 64), "--key", "id", "--lock", "l"},
		{"fences", "--table", "t", "--key", "", "--lock", "l"},
		{"fences", "--table", "t", "--key", "id", "--lock", long},
		{"fences", "--table", "t", "--key", "id", "--lock-column", "a\x00"},
		{"locks", "show", ""},
		{"locks", "show", long},
		{"locks", "show", "a\xff"},
		{"exporter", "--listen", "bogus"},
		{"exporter", "--listen", ""},
	} {
		r := run(t, closed, args...)
		if r.code != ExitUsage || strings.Contains(r.stderr, "cannot connect") {
			t.Errorf("pgfence %q: code %d, stderr %q; want %d before connecting", args, r.code, r.stderr, ExitUsage)
		}
	}
	// A group without a subcommand still shows its help.
	if r := run(t, closed, "migrate"); r.code != ExitOK || !strings.Contains(r.stdout, "pgfence migrate [command]") {
		t.Errorf("pgfence migrate: code %d, stdout %q", r.code, r.stdout)
	}
	// help for a command that exists shows its help.
	for _, args := range [][]string{{"help"}, {"help", "migrate"}, {"help", "migrate", "up"}, {"help", "locks", "show"}} {
		want := "pgfence " + strings.Join(args[1:], " ")
		if len(args) == 1 {
			want = "pgfence [command]"
		}
		if r := run(t, closed, args...); r.code != ExitOK || !strings.Contains(r.stdout, want) {
			t.Errorf("pgfence %q: code %d, stdout %q; want 0 and %q", args, r.code, r.stdout, want)
		}
	}
}
