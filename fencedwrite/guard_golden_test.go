package fencedwrite_test

import (
	"context"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

var updateGolden = flag.Bool("update-guard-golden", false, "rewrite fencedwrite/testdata/guard/*.plpgsql from what pgfence.guard() generates")

// TestGuardSourceGolden: the trigger function pgfence.guard() generates is
// built with format() from templates with positional arguments; this test
// holds its whole source, for every kind of lock source and both modes,
// against the files in testdata/guard, so that any change to what the
// generator emits is seen in review as a change to those files. After a
// deliberate change of the generator, rewrite them with
//
//	go test -run TestGuardSourceGolden ./fencedwrite -update-guard-golden
//
// and read the diff.
func TestGuardSourceGolden(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `
		CREATE TABLE golden (
			id       bigint,
			region   text NOT NULL,
			lock_col text NOT NULL,
			lock_gen text GENERATED ALWAYS AS ('store:' || region) STORED,
			v        text,
			fence    bigint NOT NULL DEFAULT 0,
			PRIMARY KEY (id, region)
		)`)
	cases := []struct {
		file string
		opts fencedwrite.GuardOptions
	}{
		{"fixed-strict", fencedwrite.GuardOptions{LockName: "golden-lock"}},
		{"fixed-reentrant", fencedwrite.GuardOptions{LockName: "golden-lock", Mode: fencedwrite.Reentrant}},
		{"column-strict", fencedwrite.GuardOptions{LockNameColumn: "lock_col"}},
		{"generated-column-strict", fencedwrite.GuardOptions{LockNameColumn: "lock_gen"}},
		{"expression-reentrant", fencedwrite.GuardOptions{LockNameExpression: "'region:' || region"}},
	}
	for _, c := range cases {
		if err := fencedwrite.Guard(ctx, pool, "golden", c.opts); err != nil {
			t.Fatalf("%s: %v", c.file, err)
		}
		var src string
		if err := pool.QueryRow(ctx, `
			SELECT p.prosrc FROM pgfence.guarded_tables g JOIN pg_proc p ON p.proname = g.trigger_function
			JOIN pg_namespace n ON n.oid = p.pronamespace AND n.nspname = 'pgfence'
			WHERE g.relid = 'golden'::regclass`).Scan(&src); err != nil {
			t.Fatalf("%s: read the trigger function: %v", c.file, err)
		}
		path := filepath.Join("testdata", "guard", c.file+".plpgsql")
		if *updateGolden {
			if err := os.WriteFile(path, []byte(src), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		want, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("%s: %v (create it with -update-guard-golden)", c.file, err)
		}
		if src != string(want) {
			got, exp := strings.Split(src, "\n"), strings.Split(string(want), "\n")
			for i := 0; i < max(len(got), len(exp)); i++ {
				var g, e string
				if i < len(got) {
					g = got[i]
				}
				if i < len(exp) {
					e = exp[i]
				}
				if g != e {
					t.Errorf("%s: pgfence.guard() generates a different trigger source than %s; first difference at line %d:\n got: %q\nwant: %q\n"+
						"(if the generator changed on purpose, run with -update-guard-golden and review the diff)", c.file, path, i+1, g, e)
					break
				}
			}
		}
	}
}
