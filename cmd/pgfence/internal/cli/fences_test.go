package cli

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// fenceKeys returns the first key column of each row of `fences --json`.
func fenceKeys(t *testing.T, stdout string) []string {
	t.Helper()
	var rows []fenceRow
	if err := json.Unmarshal([]byte(stdout), &rows); err != nil {
		t.Fatalf("fences --json: %v: %q", err, stdout)
	}
	keys := make([]string, len(rows))
	for i, r := range rows {
		if len(r.Key) == 0 || r.Key[0] == nil {
			keys[i] = "<null>"
		} else {
			keys[i] = *r.Key[0]
		}
	}
	return keys
}

// TestFencesMisspeltLockIsNotFound: a --lock with no lock row (a misspelt
// name) exits 3 and lists nothing. It flagged every row written with a
// fence above 0 FORGED and exited 5: a false forgery alarm.
func TestFencesMisspeltLockIsNotFound(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	if _, err := pool.Exec(context.Background(), `
		INSERT INTO pgfence.locks(name, token) VALUES ('invoices', 7);
		CREATE TABLE invoices (id bigint PRIMARY KEY, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO invoices VALUES (1, 7), (2, 3);`); err != nil {
		t.Fatal(err)
	}
	if r := run(t, dsn, "fences", "--table", "invoices", "--lock", "invoices"); r.code != ExitOK {
		t.Fatalf("fences with the right lock: %+v", r)
	}
	for _, args := range [][]string{
		{"fences", "--table", "invoices", "--lock", "invoice"},
		{"fences", "--table", "invoices", "--lock", "invoice", "--json"},
	} {
		r := run(t, dsn, args...)
		if r.code != ExitNotFound || r.stdout != "" || !strings.Contains(r.stderr, `no lock named "invoice":`) {
			t.Errorf("pgfence %q: code %d, stdout %q, stderr %q; want %d, nothing listed", args, r.code, r.stdout, r.stderr, ExitNotFound)
		}
	}
}

// TestFencesLockColumnMissingLockIsNoLock: under --lock-column, a row
// whose lock has no lock row is no-lock when its fence is 0, and FORGED
// (exit 5) when its fence is above 0: that lock issued no token, as
// pgfence.guarded_fences counts it.
func TestFencesLockColumnMissingLockIsNoLock(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	if _, err := pool.Exec(context.Background(), `
		INSERT INTO pgfence.locks(name, token) VALUES ('store:1', 5);
		CREATE TABLE stock (id int PRIMARY KEY, store_lock text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO stock VALUES (1, 'store:1', 5), (2, 'stor:1', 4), (3, 'stor:1', 0), (4, NULL, 2);`); err != nil {
		t.Fatal(err)
	}
	r := run(t, dsn, "fences", "--table", "stock", "--lock-column", "store_lock", "--json")
	if r.code != ExitForged || !strings.Contains(r.stderr, "2 row(s) carry a fence above") {
		t.Fatalf("fences --lock-column with missing lock rows: code %d, stderr %q; want %d, 2 rows", r.code, r.stderr, ExitForged)
	}
	var rows []fenceRow
	if err := json.Unmarshal([]byte(r.stdout), &rows); err != nil {
		t.Fatal(err)
	}
	want := []string{fenceCurrent, fenceForged, fenceNoLock, fenceForged}
	if len(rows) != len(want) {
		t.Fatalf("rows: %s", r.stdout)
	}
	for i, w := range want {
		if rows[i].Status != w {
			t.Errorf("row %s (fence %d): status %q, want %q", keySafe(rows[i].Key[0]), rows[i].Fence, rows[i].Status, w)
		}
	}
	// Without them, the no-lock row alone exits 0.
	if _, err := pool.Exec(context.Background(), `DELETE FROM stock WHERE id IN (2, 4)`); err != nil {
		t.Fatal(err)
	}
	if r = run(t, dsn, "fences", "--table", "stock", "--lock-column", "store_lock"); r.code != ExitOK {
		t.Errorf("a no-lock row with fence 0: code %d, stderr %q; want 0", r.code, r.stderr)
	}
}

// TestFencesCountsEveryRowBeyondLimit: the forgery check covers the whole
// table. A forged row beyond --limit exits 5, the error says it is not
// shown, and stderr says how many rows were left out with the count of each
// status; the same with --json. It read --limit rows and said nothing, so
// a forged row 1001st in key order passed with exit 0.
func TestFencesCountsEveryRowBeyondLimit(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	if _, err := pool.Exec(context.Background(), `
		INSERT INTO pgfence.locks(name, token) VALUES ('big', 5);
		CREATE TABLE big (id bigint PRIMARY KEY, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO big SELECT g, 5 FROM generate_series(1, 999) g;
		INSERT INTO big VALUES (1000, 4), (99999, 99); -- behind; forged, last in key order`); err != nil {
		t.Fatal(err)
	}
	const note = "pgfence: 1 more row(s) not shown (--limit 1000); all 1001 rows: 999 current, 1 behind, 1 FORGED, 0 no-lock"
	for _, args := range [][]string{
		{"fences", "--table", "big", "--lock", "big"},
		{"fences", "--table", "big", "--lock", "big", "--json"},
	} {
		r := run(t, dsn, args...)
		if r.code != ExitForged {
			t.Errorf("pgfence %q over 1001 rows, row 99999 forged: code %d, stderr %q; want %d", args, r.code, r.stderr, ExitForged)
		}
		if !strings.Contains(r.stderr, note) || !strings.Contains(r.stderr, "1 row(s) carry a fence above any token issued by their lock (1 of them not shown: beyond --limit 1000)") {
			t.Errorf("pgfence %q: stderr %q; want %q and the forged row counted", args, r.stderr, note)
		}
		if strings.Contains(r.stdout, "99999") || strings.Contains(r.stdout, "FORGED") {
			t.Errorf("pgfence %q: the row beyond --limit was listed", args)
		}
	}
	// Within the limit: the row is listed, and no note.
	r := run(t, dsn, "fences", "--table", "big", "--lock", "big", "--limit", "1001")
	if r.code != ExitForged || strings.Contains(r.stderr, "not shown") || !strings.Contains(r.stdout, "99999") {
		t.Errorf("--limit 1001: code %d, stderr %q", r.code, r.stderr)
	}
	// Nothing forged, but cut: exit 0 and the note.
	if _, err := pool.Exec(context.Background(), `DELETE FROM big WHERE id = 99999`); err != nil {
		t.Fatal(err)
	}
	r = run(t, dsn, "fences", "--table", "big", "--lock", "big", "--limit", "998")
	if want := "pgfence: 2 more row(s) not shown (--limit 998); all 1000 rows: 999 current, 1 behind, 0 FORGED, 0 no-lock"; r.code != ExitOK || !strings.Contains(r.stderr, want) {
		t.Errorf("--limit 998, nothing forged: code %d, stderr %q; want 0 and %q", r.code, r.stderr, want)
	}
}

// TestFencesListsKeysInTheirOwnOrder: rows are listed in the order of the
// key columns' types (2 before 10, dates as dates), NULL last, so --limit
// keeps the lowest keys; a key type without an ordering (json) is listed in
// its text's order. Keys were ordered as text: 1, 10, 11, 2.
func TestFencesListsKeysInTheirOwnOrder(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	if _, err := pool.Exec(context.Background(), `
		INSERT INTO pgfence.locks(name, token) VALUES ('l', 1);
		CREATE TABLE num (id int, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO num SELECT g, 1 FROM generate_series(1, 12) g;
		INSERT INTO num VALUES (NULL, 1), (-3, 1);
		CREATE TABLE twokeys (a int, b numeric, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO twokeys VALUES (10, 2, 1), (9, 10, 1), (10, 10.5, 1), (9, 9, 1);
		CREATE TABLE doc (j json, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO doc VALUES ('{"b":1}', 1), ('[2]', 1), ('{"a":1}', 1);`); err != nil {
		t.Fatal(err)
	}
	r := run(t, dsn, "fences", "--table", "num", "--lock", "l", "--json")
	if got, want := strings.Join(fenceKeys(t, r.stdout), " "), "-3 1 2 3 4 5 6 7 8 9 10 11 12 <null>"; r.code != ExitOK || got != want {
		t.Errorf("int keys: code %d, order %s, want %s", r.code, got, want)
	}
	r = run(t, dsn, "fences", "--table", "num", "--lock", "l", "--json", "--limit", "3")
	if got, want := strings.Join(fenceKeys(t, r.stdout), " "), "-3 1 2"; got != want || !strings.Contains(r.stderr, "11 more row(s) not shown") {
		t.Errorf("int keys, --limit 3: order %s (want %s), stderr %q", got, want, r.stderr)
	}
	r = run(t, dsn, "fences", "--table", "twokeys", "--key", "a,b", "--lock", "l")
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n")[1:] {
		got = append(got, strings.Fields(line)[0])
	}
	if want := "9,9 9,10 10,2 10,10.5"; r.code != ExitOK || strings.Join(got, " ") != want {
		t.Errorf("two keys: code %d, order %s, want %s\n%s", r.code, strings.Join(got, " "), want, r.stdout)
	}
	r = run(t, dsn, "fences", "--table", "doc", "--key", "j", "--lock", "l", "--json")
	if got, want := strings.Join(fenceKeys(t, r.stdout), " "), `[2] {"a":1} {"b":1}`; r.code != ExitOK || got != want {
		t.Errorf("json keys: code %d (stderr %q), order %s, want %s", r.code, r.stderr, got, want)
	}
}

// TestFencesLockColumnCollation: under --lock-column, a row's lock name is
// matched byte for byte, as the guard matches it, whatever the column's
// collation. Under a nondeterministic (case-insensitive) one a row of
// 'FS-INV', a lock never issued, matched the lock 'fs-inv' and passed as
// current (exit 0), and every row was counted once per matching lock.
func TestFencesLockColumnCollation(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	if _, err := pool.Exec(context.Background(), `
		CREATE COLLATION public.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false);
		INSERT INTO pgfence.locks(name, token) VALUES ('fs-acme', 1), ('fs-ACME', 3), ('fs-inv', 1);
		CREATE TABLE fs_ci (id int PRIMARY KEY, lock text COLLATE public.ci NOT NULL, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO fs_ci VALUES (1, 'fs-acme', 1), (2, 'fs-ACME', 3), (3, 'fs-inv', 1), (4, 'FS-INV', 1);`); err != nil {
		t.Fatal(err)
	}
	r := run(t, dsn, "fences", "--table", "fs_ci", "--lock-column", "lock", "--json")
	if r.code != ExitForged || !strings.Contains(r.stderr, "1 row(s) carry a fence above") {
		t.Fatalf("fences --lock-column on a case-insensitive column: code %d, stderr %q; want %d, 1 row", r.code, r.stderr, ExitForged)
	}
	var rows []fenceRow
	if err := json.Unmarshal([]byte(r.stdout), &rows); err != nil {
		t.Fatal(err)
	}
	want := []string{fenceCurrent, fenceCurrent, fenceCurrent, fenceForged}
	if len(rows) != len(want) {
		t.Fatalf("rows: %s", r.stdout)
	}
	for i, w := range want {
		if rows[i].Status != w {
			t.Errorf("row %s (fence %d): status %q, want %q", keySafe(rows[i].Key[0]), rows[i].Fence, rows[i].Status, w)
		}
	}
}
