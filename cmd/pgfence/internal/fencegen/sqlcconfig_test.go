package fencegen_test

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/cmd/pgfence/internal/fencegen"
)

func TestSQLCConfigDirs(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, file, content, block string
		mig, qry                   string // relative to the config's directory
		notes                      int
		err                        string
	}{
		{name: "v2 yaml", file: "sqlc.yaml", content: `version: "2"
sql:
  - engine: postgresql
    schema: db/migrations
    queries: db/queries
    gen: {go: {package: db, out: db}}
`, mig: "db/migrations", qry: "db/queries"},
		{name: "unquoted version, lists", file: "sqlc.yml", content: `version: 2
sql:
  - engine: postgresql
    schema: [db/migrations]
    queries:
      - db/queries
`, mig: "db/migrations", qry: "db/queries"},
		{name: "json", file: "sqlc.json", content: `{"version": "2", "sql": [{"engine": "postgresql", "schema": "schema", "queries": "q"}]}`,
			mig: "schema", qry: "q"},
		{name: "v1", file: "sqlc.yaml", content: `version: "1"
packages:
  - path: internal/db
    schema: migrations
    queries: queries
`, mig: "migrations", qry: "queries"},
		{name: "schema file", file: "sqlc.yaml", content: `version: "2"
sql:
  - engine: postgresql
    schema: db/schema.sql
    queries: db/query.sql
`, mig: "db", qry: "db", notes: 2},
		{name: "glob", file: "sqlc.yaml", content: `version: "2"
sql:
  - engine: postgresql
    schema: "db/migrations/*.sql"
    queries: db/queries
`, mig: "db/migrations", qry: "db/queries", notes: 1},
		{name: "a directory among files", file: "sqlc.yaml", content: `version: "2"
sql:
  - engine: postgresql
    schema: [extensions.sql, db/migrations]
    queries: db/queries
`, mig: "db/migrations", qry: "db/queries"},
		{name: "pick the postgresql block", file: "sqlc.yaml", content: `version: "2"
sql:
  - engine: mysql
    schema: my/schema
    queries: my/queries
  - engine: postgresql
    schema: pg/schema
    queries: pg/queries
`, mig: "pg/schema", qry: "pg/queries"},
		{name: "several blocks", file: "sqlc.yaml", content: `version: "2"
sql:
  - engine: postgresql
    schema: a/schema
    queries: a/queries
    gen: {go: {package: adb}}
  - name: second
    engine: postgresql
    schema: b/schema
    queries: b/queries
`, err: "2 postgresql blocks (adb, second): choose one"},
		{name: "block by package", file: "sqlc.yaml", block: "adb", content: `version: "2"
sql:
  - engine: postgresql
    schema: a/schema
    queries: a/queries
    gen: {go: {package: adb}}
  - name: second
    engine: postgresql
    schema: b/schema
    queries: b/queries
`, mig: "a/schema", qry: "a/queries"},
		{name: "block by name", file: "sqlc.yaml", block: "second", content: `version: "2"
sql:
  - engine: postgresql
    schema: a/schema
    queries: a/queries
  - name: second
    engine: postgresql
    schema: b/schema
    queries: b/queries
`, mig: "b/schema", qry: "b/queries"},
		{name: "unknown block", file: "sqlc.yaml", block: "nope", content: `version: "2"
sql:
  - {engine: postgresql, schema: a, queries: b, name: x}
`, err: `no block named "nope" (postgresql blocks: x)`},
		{name: "mysql only", file: "sqlc.yaml", content: `version: "2"
sql:
  - {engine: mysql, schema: a, queries: b}
`, err: "no postgresql block"},
		{name: "no version", file: "sqlc.yaml", content: "sql: []\n", err: "no version"},
		{name: "version 3", file: "sqlc.yaml", content: "version: \"3\"\n", err: "unknown version"},
		{name: "two directories", file: "sqlc.yaml", content: `version: "2"
sql:
  - {engine: postgresql, schema: [a, b], queries: q}
`, err: "several directories"},
		{name: "not yaml", file: "sqlc.yaml", content: "version: [\n", err: "sqlc.yaml"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			path := filepath.Join(dir, c.file)
			writeFile(t, path, c.content)
			writeFile(t, filepath.Join(dir, "extensions.sql"), "")
			writeFile(t, filepath.Join(dir, "db", "migrations", "00001_x.sql"), "")
			found, err := fencegen.FindSQLCConfig(dir)
			if err != nil || found != path {
				t.Fatalf("FindSQLCConfig = %q, %v", found, err)
			}
			cfg, err := fencegen.ReadSQLCConfig(path)
			var d fencegen.Dirs
			var notes []string
			if err == nil {
				d, notes, err = cfg.Dirs(c.block)
			}
			if c.err != "" {
				if !errors.Is(err, fencegen.ErrSQLCConfig) || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("err = %v, want %q", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d.Migrations != filepath.Join(dir, c.mig) || d.Queries != filepath.Join(dir, c.qry) || len(notes) != c.notes {
				t.Errorf("Dirs = %+v, notes %q; want %s, %s, %d notes", d, notes, c.mig, c.qry, c.notes)
			}
		})
	}
}

func TestFindSQLCConfig(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if p, err := fencegen.FindSQLCConfig(dir); p != "" || err != nil {
		t.Errorf("empty dir: %q, %v", p, err)
	}
	writeFile(t, filepath.Join(dir, "sqlc.yml"), "version: \"2\"\n")
	if p, err := fencegen.FindSQLCConfig(dir); p != filepath.Join(dir, "sqlc.yml") || err != nil {
		t.Errorf("sqlc.yml: %q, %v", p, err)
	}
	writeFile(t, filepath.Join(dir, "sqlc.yaml"), "version: \"2\"\n")
	if p, err := fencegen.FindSQLCConfig(dir); p != filepath.Join(dir, "sqlc.yaml") || err != nil {
		t.Errorf("sqlc.yaml first: %q, %v", p, err)
	}
	writeFile(t, filepath.Join(dir, "sqlc.json"), "{}")
	if _, err := fencegen.FindSQLCConfig(dir); !errors.Is(err, fencegen.ErrSQLCConfig) {
		t.Errorf("json and yaml: %v", err)
	}
}
