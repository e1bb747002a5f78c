package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock"
)

// runTo is run with stdout written to w.
func runTo(t *testing.T, dsn string, w io.Writer, args ...string) result {
	t.Helper()
	var errb bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	code := Main(ctx, args, Env{
		Stdout: w,
		Stderr: &errb,
		Getenv: func(k string) string {
			if k == "DATABASE_URL" {
				return dsn
			}
			return ""
		},
	})
	return result{"", errb.String(), code}
}

// failWriter fails every write, as stdout on /dev/full or a closed pipe.
type failWriter struct{}

func (failWriter) Write([]byte) (int, error) { return 0, errors.New("no space left on device") }

// TestFencesRefusesNonTables: fences reads only tables and partitioned
// tables. A view's query (here a function that records its calls, the view
// owner's code) would run as the role running pgfence, often a superuser,
// outside any read-only transaction.
func TestFencesRefusesNonTables(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `
		INSERT INTO pgfence.locks(name, token) VALUES ('l', 1);
		CREATE TABLE calls (who text, at timestamptz DEFAULT now());
		CREATE FUNCTION public.evil(g bigint) RETURNS bigint LANGUAGE plpgsql AS
		  $$BEGIN INSERT INTO public.calls(who) VALUES (current_user); RETURN g; END$$;
		CREATE VIEW v AS SELECT public.evil(g) AS id, 0::bigint AS fence FROM pg_catalog.generate_series(1, 3) g;
		CREATE MATERIALIZED VIEW mv AS SELECT g::bigint AS id, 0::bigint AS fence FROM pg_catalog.generate_series(1, 3) g;
		CREATE SEQUENCE s;
		CREATE TABLE parted (id bigint, fence bigint NOT NULL DEFAULT 0) PARTITION BY RANGE (id);
		CREATE TABLE parted_1 PARTITION OF parted FOR VALUES FROM (0) TO (100);
		INSERT INTO parted VALUES (1, 0), (2, 0);`); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ table, says string }{
		{"v", "is a view"},
		{"public.v", "is a view"},
		{"mv", "is a materialized view"},
		{"s", "is a sequence"},
	} {
		r := run(t, dsn, "fences", "--table", tc.table, "--key", "id", "--lock", "l", "--json")
		if r.code != ExitNotFound || !strings.Contains(r.stderr, tc.says) || r.stdout != "" {
			t.Errorf("fences --table %s: code %d, stderr %q, stdout %q; want %d saying %q", tc.table, r.code, r.stderr, r.stdout, ExitNotFound, tc.says)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM calls").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("the view's function ran %d time(s) as the role running pgfence fences", n)
	}
	// A partitioned table is read (LOCK TABLE locks its partitions too),
	// also by a role that may read only the parent, as a SELECT needs.
	role, oncall := pgtest.DocRole(t, "observability.md", dsn, "pgfence_oncall")
	if _, err := pool.Exec(ctx, "GRANT SELECT ON parted TO "+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	for _, who := range []string{dsn, oncall} {
		r := run(t, who, "fences", "--table", "parted", "--key", "id", "--lock", "l", "--json")
		var rows []fenceRow
		if err := json.Unmarshal([]byte(r.stdout), &rows); r.code != 0 || err != nil || len(rows) != 2 {
			t.Errorf("partitioned table: %+v %v", r, err)
		}
	}
}

// TestFencesNullKey: a NULL key is JSON null and NULL in the table, apart
// from the text 'NULL', which is quoted; a comma in a key is quoted too.
func TestFencesNullKey(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	if _, err := pool.Exec(context.Background(), `
		INSERT INTO pgfence.locks(name, token) VALUES ('l', 1);
		CREATE TABLE nk (k text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO nk VALUES (NULL, 1), ('NULL', 1), ('a,b', 1), ('x', 1);`); err != nil {
		t.Fatal(err)
	}
	r := run(t, dsn, "fences", "--table", "nk", "--key", "k", "--lock", "l", "--json")
	if r.code != 0 {
		t.Fatalf("%+v", r)
	}
	var rows []struct {
		Key []*string `json:"key"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &rows); err != nil || len(rows) != 4 {
		t.Fatalf("%s: %v", r.stdout, err)
	}
	var got []string
	for _, row := range rows {
		if len(row.Key) != 1 {
			t.Fatalf("key %v", row.Key)
		}
		if row.Key[0] == nil {
			got = append(got, "<null>")
		} else {
			got = append(got, *row.Key[0])
		}
	}
	// Text order, NULL last.
	if want := []string{"NULL", "a,b", "x", "<null>"}; strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("--json keys %q, want %q", got, want)
	}
	r = run(t, dsn, "fences", "--table", "nk", "--key", "k", "--lock", "l")
	if r.code != 0 {
		t.Fatalf("%+v", r)
	}
	var first []string
	for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n")[1:] {
		first = append(first, strings.Fields(line)[0])
	}
	if want := []string{`"NULL"`, `"a,b"`, "x", "NULL"}; strings.Join(first, "|") != strings.Join(want, "|") {
		t.Errorf("table keys %q, want %q:\n%s", first, want, r.stdout)
	}
}

// TestMigrateReadsCreateNothing: migrate status and version only read. On a
// database never migrated they create no schema (which, created by whoever
// looked, could keep the migrating role from migrating) and report nothing
// applied.
func TestMigrateReadsCreateNothing(t *testing.T) {
	t.Parallel()
	dsn := pgtest.EmptyDSN(t)
	pool := pgtest.PoolFor(t, dsn)
	schemaExists := func() bool {
		t.Helper()
		var ok bool
		if err := pool.QueryRow(context.Background(), "SELECT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = 'pgfence')").Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	r := run(t, dsn, "migrate", "status", "--json")
	var st []struct {
		Version int64 `json:"version"`
		Applied bool  `json:"applied"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &st); r.code != 0 || err != nil || len(st) == 0 {
		t.Fatalf("status --json: %+v %v", r, err)
	}
	for _, s := range st {
		if s.Applied {
			t.Errorf("migration %d applied on an empty database", s.Version)
		}
	}
	if !strings.Contains(r.stderr, "not migrated") {
		t.Errorf("status stderr %q, want a note that the database is not migrated", r.stderr)
	}
	r = run(t, dsn, "migrate", "status")
	if r.code != 0 || strings.Contains(r.stdout, "applied") || strings.Count(r.stdout, "pending") != len(st) {
		t.Errorf("status: %+v", r)
	}
	r = run(t, dsn, "migrate", "version", "--json")
	var v struct{ Version, Latest int64 }
	if err := json.Unmarshal([]byte(r.stdout), &v); r.code != 0 || err != nil || v.Version != 0 || v.Latest != st[len(st)-1].Version {
		t.Errorf("version --json: %+v %v", r, err)
	}
	r = run(t, dsn, "migrate", "version")
	if r.code != 0 || !strings.HasPrefix(r.stdout, "version 0 (latest ") {
		t.Errorf("version: %+v", r)
	}
	if schemaExists() {
		t.Fatal("migrate status/version created schema pgfence")
	}
	if r := run(t, dsn, "migrate", "up"); r.code != 0 {
		t.Fatalf("up: %+v", r)
	}
	r = run(t, dsn, "migrate", "version", "--json")
	if err := json.Unmarshal([]byte(r.stdout), &v); r.code != 0 || err != nil || v.Version != v.Latest || strings.Contains(r.stderr, "not migrated") {
		t.Errorf("version after up: %+v %v", r, err)
	}
}

// TestAcquireWriteFailure: when acquire cannot print the lease (stdout on a
// full disk, a closed pipe), nobody has its key: acquire releases it and
// exits 1 instead of leaving it held for its TTL.
func TestAcquireWriteFailure(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	for _, args := range [][]string{
		{"acquire", "--lock", "unprinted", "--ttl", "1h"},
		{"acquire", "--lock", "unprinted-json", "--ttl", "1h", "--json"},
	} {
		r := runTo(t, dsn, failWriter{}, args...)
		if r.code != ExitError || !strings.Contains(r.stderr, "cannot write the lease to stdout") || !strings.Contains(r.stderr, "released") {
			t.Errorf("%v: code %d, stderr %q; want %d", args, r.code, r.stderr, ExitError)
		}
		if v := lockState(t, dsn, args[2]); v.State != "free" {
			t.Errorf("%v: lease left %s after a failed write", args, v.State)
		}
	}
}

// TestWriteFailuresExit1: renew, release and migrate version exit 1 when
// they cannot print their result.
func TestWriteFailuresExit1(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	r := run(t, dsn, "acquire", "--lock", "w", "--ttl", "1h", "--json")
	var got struct {
		Token int64  `json:"token"`
		Key   string `json:"key"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &got); r.code != 0 || err != nil {
		t.Fatalf("acquire: %+v %v", r, err)
	}
	tok := strconv.FormatInt(got.Token, 10)
	for _, args := range [][]string{
		{"renew", "--lock", "w", "--token", tok, "--key", got.Key},
		{"renew", "--lock", "w", "--token", tok, "--key", got.Key, "--json"},
		{"release", "--lock", "w", "--token", tok, "--key", got.Key},
		{"migrate", "version"},
		{"migrate", "version", "--json"},
	} {
		r := runTo(t, dsn, failWriter{}, args...)
		if r.code != ExitError || !strings.Contains(r.stderr, "cannot write to stdout") {
			t.Errorf("%v with a failing stdout: code %d, stderr %q; want %d", args, r.code, r.stderr, ExitError)
		}
	}
	if v := lockState(t, dsn, "w"); v.State != "free" {
		t.Errorf("release with a failing stdout did not release: %s", v.State)
	}
}

// TestExitCodeNotFromErrorText: the exit code of an error does not depend on
// its text: a lock named "accepts nightly" that the role may not take exits
// 1 as "nightly" does; cobra's own errors are still 2.
func TestExitCodeNotFromErrorText(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	_, oncall := pgtest.DocRole(t, "observability.md", dsn, "pgfence_oncall") // no lease grants
	for _, name := range []string{"nightly", "accepts nightly", "invalid argument", "required flag x", "unknown command y"} {
		r := run(t, oncall, "acquire", "--lock", name, "--no-wait")
		if r.code != ExitError || !strings.Contains(r.stderr, "permission denied") {
			t.Errorf("acquire --lock %q without the grants: code %d, stderr %q; want %d", name, r.code, r.stderr, ExitError)
		}
	}
	const closed = "postgres://nobody@127.0.0.1:1/none?sslmode=disable&connect_timeout=2"
	for _, tc := range []struct {
		args []string
		says string
	}{
		{[]string{"lokcs"}, `unknown command "lokcs" for "pgfence" (did you mean locks?)`},
		{[]string{"locks", "--bogus"}, "unknown flag"},
		{[]string{"locks", "-Z"}, "unknown shorthand"},
		{[]string{"locks", "--limit", "many"}, "invalid argument"},
		{[]string{"locks", "--limit"}, "flag needs an argument"},
		{[]string{"locks", "extra"}, "unknown command"},
		{[]string{"locks", "show"}, "accepts 1 arg"},
		{[]string{"locks", "show", "a", "b"}, "accepts 1 arg"},
		{[]string{"run", "--lock", "x"}, "requires at least 1 arg"},
		{[]string{"migrate", "status", "now"}, "unknown command"},
		{[]string{"completion", "bash", "extra"}, ""},
	} {
		r := run(t, closed, tc.args...)
		if r.code != ExitUsage || !strings.Contains(r.stderr, tc.says) {
			t.Errorf("%q: code %d, stderr %q; want %d saying %q", tc.args, r.code, r.stderr, ExitUsage, tc.says)
		}
	}
	if r := run(t, closed); r.code != ExitOK || !strings.Contains(r.stdout, "Available Commands") {
		t.Errorf("pgfence without arguments: %+v", r)
	}
}

// TestRenewReleaseErrorsNoForeignHolder: a lost lease's error does not name
// the holder of the CLI's own Locker (random, never stored).
func TestRenewReleaseErrorsNoForeignHolder(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	locker, err := pglock.New(pool, &pglock.Config{Holder: "real-holder/1"})
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.TryAcquire(ctx, "h", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Release(ctx)
	const wrongKey = "00112233445566778899aabbccddeeff"
	for _, cmd := range []string{"renew", "release"} {
		r := run(t, dsn, cmd, "--lock", "h", "--token", strconv.FormatInt(lease.Token(), 10), "--key", wrongKey)
		if r.code != ExitLeaseLost {
			t.Errorf("%s with another key: code %d, want %d (%s)", cmd, r.code, ExitLeaseLost, r.stderr)
		}
		if strings.Contains(r.stderr, "(holder ") {
			t.Errorf("%s: stderr names a holder that is not the lease's: %q", cmd, r.stderr)
		}
	}
}

// TestMoreBadInputBeforeConnecting: flags checked before connecting, exit
// 2 naming the flag, with no database.
func TestMoreBadInputBeforeConnecting(t *testing.T) {
	t.Parallel()
	const closed = "postgres://nobody@127.0.0.1:1/none?sslmode=disable&connect_timeout=2"
	for _, tc := range []struct {
		args []string
		says string
	}{
		{[]string{"fences", "--table", "t", "--key", "id", "--fence-column", "", "--lock", "l"}, "--fence-column"},
		{[]string{"fences", "--table", "t", "--key", "id", "--fence-column", "", "--lock-column", "c"}, "--fence-column"},
		{[]string{"fences", "--table", "t", "--key", "id", "--lock-column", strings.Repeat("c", 64)}, "--lock-column"},
		{[]string{"jobs", "--queue", ""}, "--queue"},
		{[]string{"jobs", "--queue", "a\x01b"}, "--queue"},
		{[]string{"jobs", "--queue", strings.Repeat("q", 129)}, "--queue"},
		{[]string{"jobs", "--queue", "a\xffb"}, "--queue"},
	} {
		r := run(t, closed, tc.args...)
		if r.code != ExitUsage || strings.Contains(r.stderr, "cannot connect") || !strings.Contains(r.stderr, tc.says) {
			t.Errorf("%q: code %d, stderr %q; want %d naming %s before connecting", tc.args, r.code, r.stderr, ExitUsage, tc.says)
		}
	}
}

// TestDemoConnectionString: demo parses its connection string as every
// other command does (exit 2, password hidden), and gives it to its workers
// in their environment, never on their command line, which every user of
// the machine can read.
func TestDemoConnectionString(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{
		"password = s3cr3tpw host=localhost port = abc",
		"postgres://app:s3cr3tpw@localhost:abc/db",
	} {
		r := run(t, dsn, "demo")
		if r.code != ExitUsage || strings.Contains(r.stdout+r.stderr, "cr3tpw") || !strings.Contains(r.stderr, "invalid connection string") {
			t.Errorf("demo with %q: code %d, stderr %q", dsn, r.code, r.stderr)
		}
	}

	dir := t.TempDir()
	argsFile, envFile := filepath.Join(dir, "args"), filepath.Join(dir, "env")
	exe := filepath.Join(dir, "worker")
	script := "#!/bin/sh\nprintf '%s\\n' \"$@\" > '" + argsFile + "'\nprintf '%s' \"$DATABASE_URL\" > '" + envFile + "'\n"
	if err := os.WriteFile(exe, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	const dsn = "postgres://app:s3cr3tpw@db.example:5432/app"
	d := &demoRun{out: io.Discard, exe: exe, dsn: dsn, table: "s.accounts", lock: "l", ttl: time.Second, start: time.Now()}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, err := d.startWorker(ctx, "A", 1)
	if err != nil {
		t.Fatal(err)
	}
	for range w.events {
	}
	if err := <-w.done; err != nil {
		t.Fatalf("worker: %v", err)
	}
	args, err := os.ReadFile(argsFile)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(args), "s3cr3tpw") || !strings.Contains(string(args), "demo-worker") {
		t.Errorf("worker arguments carry the connection string:\n%s", args)
	}
	env, err := os.ReadFile(envFile)
	if err != nil {
		t.Fatal(err)
	}
	if string(env) != dsn {
		t.Errorf("worker DATABASE_URL = %q, want %q", env, dsn)
	}
}
