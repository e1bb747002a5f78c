package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// migrateVersion returns the applied and the latest known schema version
// (`migrate version --json`).
func migrateVersion(t *testing.T, dsn string) (version, latest int64) {
	t.Helper()
	r := run(t, dsn, "migrate", "version", "--json")
	var v struct{ Version, Latest int64 }
	if err := json.Unmarshal([]byte(r.stdout), &v); r.code != ExitOK || err != nil {
		t.Fatalf("migrate version: %+v %v", r, err)
	}
	return v.Version, v.Latest
}

// migrateVersions returns the versions of `migrate status --json`.
func migrateVersions(t *testing.T, dsn string) []int64 {
	t.Helper()
	r := run(t, dsn, "migrate", "status", "--json")
	var st []struct {
		Version int64 `json:"version"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &st); r.code != ExitOK || err != nil || len(st) < 2 {
		t.Fatalf("migrate status: %+v %v", r, err)
	}
	vs := make([]int64, len(st))
	for i, s := range st {
		vs[i] = s.Version
	}
	return vs
}

// TestMigrateDownToZeroNeedsYes: rolling back to version 0 (--all, --to 0,
// or a plain down when only the baseline is applied) drops every lease, job
// and guard: without --yes it exits 2 and changes nothing; with --yes it
// runs. `migrate down --all` ran with no confirmation at all.
func TestMigrateDownToZeroNeedsYes(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE acct (id int PRIMARY KEY, balance int NOT NULL, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO acct VALUES (1, 100, 0);
		SELECT pgfence.guard('public.acct', lock_name => 'acct');`); err != nil {
		t.Fatal(err)
	}
	if r := run(t, dsn, "acquire", "--lock", "nightly", "--ttl", "1h"); r.code != ExitOK {
		t.Fatalf("acquire: %+v", r)
	}
	if _, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: "mail"}); err != nil {
		t.Fatal(err)
	}
	_, latest := migrateVersion(t, dsn)
	intact := func(when string) {
		t.Helper()
		if v, _ := migrateVersion(t, dsn); v != latest {
			t.Fatalf("%s: version %d, want %d", when, v, latest)
		}
		if _, err := pool.Exec(ctx, `UPDATE acct SET balance = 1 WHERE id = 1`); err == nil {
			t.Fatalf("%s: the guard accepted an unfenced update", when)
		}
		var n int
		if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM pgfence.locks) + (SELECT count(*) FROM pgfence.jobs)`).Scan(&n); err != nil || n != 2 {
			t.Fatalf("%s: %d locks and jobs (%v), want 2", when, n, err)
		}
	}
	intact("setup")
	for _, args := range [][]string{
		{"migrate", "down", "--all"},
		{"migrate", "down", "--to", "0"},
	} {
		r := run(t, dsn, args...)
		if r.code != ExitUsage || !strings.Contains(r.stderr, "add --yes") || !strings.Contains(r.stderr, "every lease") {
			t.Errorf("pgfence %q: code %d, stderr %q; want %d asking for --yes", args, r.code, r.stderr, ExitUsage)
		}
		intact(strings.Join(args, " "))
	}
	// Down to the baseline needs no --yes; then a plain down would undo the
	// baseline, and needs it.
	if r := run(t, dsn, "migrate", "down", "--to", "1"); r.code != ExitOK || !strings.Contains(r.stdout, "version 1\n") {
		t.Fatalf("down --to 1: %+v", r)
	}
	r := run(t, dsn, "migrate", "down")
	if r.code != ExitUsage || !strings.Contains(r.stderr, "baseline") || !strings.Contains(r.stderr, "add --yes") {
		t.Errorf("down at the baseline: code %d, stderr %q; want %d asking for --yes", r.code, r.stderr, ExitUsage)
	}
	if v, _ := migrateVersion(t, dsn); v != 1 {
		t.Fatalf("down at the baseline without --yes: version %d, want 1", v)
	}
	if r := run(t, dsn, "migrate", "up"); r.code != ExitOK {
		t.Fatalf("up: %+v", r)
	}
	r = run(t, dsn, "migrate", "down", "--all", "--yes")
	if r.code != ExitOK || !strings.HasSuffix(r.stdout, "version 0\n") {
		t.Fatalf("down --all --yes: %+v", r)
	}
	if _, err := pool.Exec(ctx, `UPDATE acct SET balance = 1 WHERE id = 1`); err != nil {
		t.Errorf("after down --all --yes the guard is still attached: %v", err)
	}
	// --to 0 --yes and a plain down --yes at the baseline run too.
	for _, tc := range []struct {
		args         []string
		fromBaseline bool
	}{
		{[]string{"migrate", "down", "--to", "0", "--yes"}, false},
		{[]string{"migrate", "down", "--yes"}, true},
	} {
		if r := run(t, dsn, "migrate", "up"); r.code != ExitOK {
			t.Fatalf("up: %+v", r)
		}
		if tc.fromBaseline {
			if r := run(t, dsn, "migrate", "down", "--to", "1"); r.code != ExitOK {
				t.Fatalf("down --to 1: %+v", r)
			}
		}
		if r := run(t, dsn, tc.args...); r.code != ExitOK || !strings.HasSuffix(r.stdout, "version 0\n") {
			t.Errorf("pgfence %q: %+v", tc.args, r)
		}
	}
}

// TestMigrateDownToRefusesVersionsItCannotReach: `migrate down --to N`
// with N above the applied version (a typo: 230 for 23) or a version no
// migration has (3, between 2 and 5) exits 2 and rolls nothing back. The
// first exited 0 having done nothing; the second rolled back to 2.
func TestMigrateDownToRefusesVersionsItCannotReach(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	versions := migrateVersions(t, dsn)
	known := map[int64]bool{}
	for _, v := range versions {
		known[v] = true
	}
	var missing int64 // the lowest version no migration has
	for missing = 1; known[missing]; missing++ {
	}
	latest := versions[len(versions)-1]
	below := versions[len(versions)-2]
	for _, tc := range []struct {
		to   int64
		says string
	}{
		{latest * 10, fmt.Sprintf("above the newest migration, version %d", latest)},
		{latest + 1, fmt.Sprintf("above the newest migration, version %d", latest)},
		{missing, fmt.Sprintf("no migration has version %d", missing)},
	} {
		r := run(t, dsn, "migrate", "down", "--to", fmt.Sprint(tc.to))
		if r.code != ExitUsage || !strings.Contains(r.stderr, tc.says) || r.stdout != "" {
			t.Errorf("migrate down --to %d: code %d, stdout %q, stderr %q; want %d saying %q", tc.to, r.code, r.stdout, r.stderr, ExitUsage, tc.says)
		}
		if v, _ := migrateVersion(t, dsn); v != latest {
			t.Fatalf("migrate down --to %d rolled back to %d", tc.to, v)
		}
	}
	// The applied version itself: nothing to do, exit 0.
	if r := run(t, dsn, "migrate", "down", "--to", fmt.Sprint(latest)); r.code != ExitOK {
		t.Errorf("migrate down --to %d (the applied version): %+v", latest, r)
	}
	// One below: rolled back; the version it left is now too high.
	if r := run(t, dsn, "migrate", "down", "--to", fmt.Sprint(below)); r.code != ExitOK || !strings.HasSuffix(r.stdout, fmt.Sprintf("version %d\n", below)) {
		t.Fatalf("migrate down --to %d: %+v", below, r)
	}
	r := run(t, dsn, "migrate", "down", "--to", fmt.Sprint(latest))
	if want := fmt.Sprintf("above the applied version %d", below); r.code != ExitUsage || !strings.Contains(r.stderr, want) {
		t.Errorf("migrate down --to %d at version %d: code %d, stderr %q; want %d saying %q", latest, below, r.code, r.stderr, ExitUsage, want)
	}
	if r := run(t, dsn, "migrate", "up"); r.code != ExitOK {
		t.Fatalf("up: %+v", r)
	}
}
