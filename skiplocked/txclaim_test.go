package skiplocked_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// importsTable creates an application table like a batch importer's and
// fills it with n rows, spread over 4 stores.
func importsTable(t testing.TB, pool *pgxpool.Pool, n int) {
	t.Helper()
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE import_rows (
			id           bigint PRIMARY KEY,
			store_id     int NOT NULL,
			status       text NOT NULL DEFAULT 'pending',
			processed_by text,
			times        int NOT NULL DEFAULT 0,
			imported_at  timestamptz
		);
		CREATE INDEX ON import_rows (store_id, id) WHERE status = 'pending';`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO import_rows (id, store_id) SELECT g, g % 4 FROM generate_series(1, $1) g`, n); err != nil {
		t.Fatal(err)
	}
}

func pendingSpec(limit int) skiplocked.Spec {
	return skiplocked.Spec{
		Table:   "import_rows",
		Key:     []string{"id"},
		Where:   []skiplocked.Cond{{Column: "status", Op: skiplocked.OpEq, Value: "pending"}},
		OrderBy: []skiplocked.Order{{Column: "id"}},
		Limit:   limit,
	}
}

func TestTxClaimerSQL(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	importsTable(t, pool, 10)
	c, err := skiplocked.NewTxClaimer(ctx, pool, skiplocked.Spec{
		Schema: "public",
		Table:  "import_rows",
		Key:    []string{"id", "store_id"},
		Where: []skiplocked.Cond{
			{Column: "status", Op: skiplocked.OpEq, Value: "pending"},
			{Column: "store_id", Op: skiplocked.OpIn, Value: []int32{1, 2}},
			{Column: "imported_at", Op: skiplocked.OpIsNull},
		},
		TrustedFilterSQL: "times < 3",
		OrderBy:          []skiplocked.Order{{Column: "store_id", Desc: true}, {Column: "id"}},
		Limit:            3,
	})
	if err != nil {
		t.Fatal(err)
	}
	want := `SELECT "id", "store_id" FROM "public"."import_rows" WHERE "status" OPERATOR(pg_catalog.=) $1 AND "store_id" OPERATOR(pg_catalog.=) ANY($2) AND "imported_at" IS NULL AND (times < 3) ORDER BY "store_id" DESC, "id" LIMIT $3 FOR UPDATE SKIP LOCKED`
	if c.SQL() != want {
		t.Fatalf("SQL =\n%s\nwant\n%s", c.SQL(), want)
	}
	// A column of a type from another schema keeps its own type's operator.
	if _, err := pool.Exec(ctx, `CREATE DOMAIN public.import_state AS text;
		ALTER TABLE import_rows ADD COLUMN state public.import_state`); err != nil {
		t.Fatal(err)
	}
	dc, err := skiplocked.NewTxClaimer(ctx, pool, skiplocked.Spec{Table: "import_rows", Key: []string{"id"},
		Where: []skiplocked.Cond{{Column: "state", Op: skiplocked.OpNe, Value: "x"}}, Limit: 1})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(dc.SQL(), `"state" <> $1`) {
		t.Fatalf("condition on a domain column: %s", dc.SQL())
	}
	type key struct {
		ID      int64 `db:"id"`
		StoreID int32 `db:"store_id"`
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	got, err := skiplocked.ClaimTx(ctx, tx, c, pgx.RowToStructByName[key])
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != "[{2 2} {6 2} {10 2}]" {
		t.Fatalf("claimed %v", got)
	}
	// WithValues rebinds the conditions; WithLimit changes the limit.
	c2, err := c.WithValues("pending", []int32{3})
	if err != nil {
		t.Fatal(err)
	}
	c2, err = c2.WithLimit(1)
	if err != nil {
		t.Fatal(err)
	}
	got, err = skiplocked.ClaimTx(ctx, tx, c2, pgx.RowToStructByName[key])
	if err != nil || fmt.Sprint(got) != "[{3 3}]" {
		t.Fatalf("claimed %v, %v", got, err)
	}
	if _, err := c.WithValues("pending"); !errors.Is(err, skiplocked.ErrInvalidSpec) {
		t.Fatalf("WithValues with too few values: %v", err)
	}
}

func TestTxClaimerRejectsBadSpecs(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	importsTable(t, pool, 1)
	if _, err := pool.Exec(ctx, "CREATE VIEW import_view AS SELECT * FROM import_rows"); err != nil {
		t.Fatal(err)
	}
	good := pendingSpec(10)
	cases := []struct {
		name   string
		mutate func(*skiplocked.Spec)
		want   error
	}{
		{"empty table", func(s *skiplocked.Spec) { s.Table = "" }, skiplocked.ErrInvalidIdentifier},
		{"SQL in table", func(s *skiplocked.Spec) { s.Table = "import_rows; DROP TABLE import_rows" }, skiplocked.ErrInvalidIdentifier},
		{"quote in column", func(s *skiplocked.Spec) { s.Key = []string{`id"--`} }, skiplocked.ErrInvalidIdentifier},
		{"dotted table", func(s *skiplocked.Spec) { s.Table = "public.import_rows" }, skiplocked.ErrInvalidIdentifier},
		{"64-byte name", func(s *skiplocked.Spec) { s.Table = strings.Repeat("t", 64) }, skiplocked.ErrInvalidIdentifier},
		{"SQL in order column", func(s *skiplocked.Spec) { s.OrderBy = []skiplocked.Order{{Column: "id DESC"}} }, skiplocked.ErrInvalidIdentifier},
		{"SQL in schema", func(s *skiplocked.Spec) { s.Schema = "public;" }, skiplocked.ErrInvalidIdentifier},
		// Since the identifier rule is shared with fencedwrite: ASCII only, no $.
		{"non-ASCII table", func(s *skiplocked.Spec) { s.Table = "impört_rows" }, skiplocked.ErrInvalidIdentifier},
		{"non-ASCII column", func(s *skiplocked.Spec) { s.Key = []string{"größe"} }, skiplocked.ErrInvalidIdentifier},
		{"dollar in column", func(s *skiplocked.Spec) { s.OrderBy[0].Column = "id$1" }, skiplocked.ErrInvalidIdentifier},
		{"leading digit", func(s *skiplocked.Spec) { s.Where[0].Column = "1status" }, skiplocked.ErrInvalidIdentifier},
		{"NUL in column", func(s *skiplocked.Spec) { s.Key = []string{"id\x00"} }, skiplocked.ErrInvalidIdentifier},
		{"other case", func(s *skiplocked.Spec) { s.Table = "Import_Rows" }, skiplocked.ErrUnknownTable},
		{"unknown table", func(s *skiplocked.Spec) { s.Table = "no_such_table" }, skiplocked.ErrUnknownTable},
		{"unknown schema", func(s *skiplocked.Spec) { s.Schema = "nope" }, skiplocked.ErrUnknownTable},
		{"view", func(s *skiplocked.Spec) { s.Table = "import_view" }, skiplocked.ErrUnknownTable},
		{"unknown key column", func(s *skiplocked.Spec) { s.Key = []string{"nope"} }, skiplocked.ErrUnknownColumn},
		{"unknown filter column", func(s *skiplocked.Spec) { s.Where[0].Column = "nope" }, skiplocked.ErrUnknownColumn},
		{"unknown order column", func(s *skiplocked.Spec) { s.OrderBy[0].Column = "nope" }, skiplocked.ErrUnknownColumn},
		{"no key", func(s *skiplocked.Spec) { s.Key = nil }, skiplocked.ErrInvalidSpec},
		{"bad operator", func(s *skiplocked.Spec) { s.Where[0].Op = "LIKE" }, skiplocked.ErrInvalidSpec},
		{"nil value", func(s *skiplocked.Spec) { s.Where[0].Value = nil }, skiplocked.ErrInvalidSpec},
		{"value on IS NULL", func(s *skiplocked.Spec) { s.Where[0].Op = skiplocked.OpIsNull }, skiplocked.ErrInvalidSpec},
		{"semicolon in trusted SQL", func(s *skiplocked.Spec) { s.TrustedFilterSQL = "true; DELETE FROM import_rows" }, skiplocked.ErrInvalidSpec},
		{"comment in trusted SQL", func(s *skiplocked.Spec) { s.TrustedFilterSQL = "true -- x" }, skiplocked.ErrInvalidSpec},
		{"placeholder in trusted SQL", func(s *skiplocked.Spec) { s.TrustedFilterSQL = "id = $1" }, skiplocked.ErrInvalidSpec},
		{"escaping parentheses", func(s *skiplocked.Spec) { s.TrustedFilterSQL = "true) OR (true" }, skiplocked.ErrInvalidSpec},
		{"zero limit", func(s *skiplocked.Spec) { s.Limit = 0 }, skiplocked.ErrInvalidLimit},
		{"negative limit", func(s *skiplocked.Spec) { s.Limit = -1 }, skiplocked.ErrInvalidLimit},
		{"huge limit", func(s *skiplocked.Spec) { s.Limit = skiplocked.MaxBatch + 1 }, skiplocked.ErrInvalidLimit},
	}
	for _, tc := range cases {
		spec := good
		spec.Key = append([]string(nil), good.Key...)
		spec.Where = append([]skiplocked.Cond(nil), good.Where...)
		spec.OrderBy = append([]skiplocked.Order(nil), good.OrderBy...)
		tc.mutate(&spec)
		if _, err := skiplocked.NewTxClaimer(ctx, pool, spec); !errors.Is(err, tc.want) {
			t.Errorf("%s: err = %v, want %v", tc.name, err, tc.want)
		}
	}
	var nilPool *pgxpool.Pool
	if _, err := skiplocked.NewTxClaimer(ctx, nilPool, good); !errors.Is(err, skiplocked.ErrNilDB) {
		t.Errorf("nil pool: %v", err)
	}
	c, err := skiplocked.NewTxClaimer(ctx, pool, good)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := skiplocked.ClaimTx(ctx, nil, c, pgx.RowTo[int64]); !errors.Is(err, skiplocked.ErrNilDB) {
		t.Errorf("nil tx: %v", err)
	}
	// A column dropped after the claimer was built: translated, nothing claimed.
	if _, err := pool.Exec(ctx, "ALTER TABLE import_rows DROP COLUMN status CASCADE"); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := skiplocked.ClaimTx(ctx, tx, c, pgx.RowTo[int64]); !errors.Is(err, skiplocked.ErrUnknownColumn) {
		t.Errorf("dropped column: %v", err)
	}
	// Nothing in the table was touched by any of the bad specs.
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM import_rows").Scan(&n); err != nil || n != 1 {
		t.Fatalf("import_rows count = %d, %v", n, err)
	}
}

// TestTxClaimerMixedCaseNames: names are used as stored in the catalog,
// quoted, without case folding.
func TestTxClaimerMixedCaseNames(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `CREATE SCHEMA "Imports";
		CREATE TABLE "Imports"."Rows" ("ID" bigint PRIMARY KEY, "Done" bool NOT NULL DEFAULT false);
		INSERT INTO "Imports"."Rows" ("ID") VALUES (1), (2)`); err != nil {
		t.Fatal(err)
	}
	c, err := skiplocked.NewTxClaimer(ctx, pool, skiplocked.Spec{Schema: "Imports", Table: "Rows", Key: []string{"ID"},
		Where: []skiplocked.Cond{{Column: "Done", Op: skiplocked.OpEq, Value: false}}, OrderBy: []skiplocked.Order{{Column: "ID"}}, Limit: 1})
	if err != nil {
		t.Fatal(err)
	}
	if want := `SELECT "ID" FROM "Imports"."Rows" WHERE "Done" OPERATOR(pg_catalog.=) $1 ORDER BY "ID" LIMIT $2 FOR UPDATE SKIP LOCKED`; c.SQL() != want {
		t.Fatalf("SQL = %s", c.SQL())
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if got, err := skiplocked.ClaimTx(ctx, tx, c, pgx.RowTo[int64]); err != nil || fmt.Sprint(got) != "[1]" {
		t.Fatalf("claimed %v, %v", got, err)
	}
	_, err = skiplocked.NewTxClaimer(ctx, pool, skiplocked.Spec{Schema: "Imports", Table: "Rows", Key: []string{"id"}, Limit: 1})
	if !errors.Is(err, skiplocked.ErrUnknownColumn) || !strings.Contains(err.Error(), `"Imports"."Rows"."id"`) {
		t.Fatalf("lower-case key column: %v", err)
	}
}

// TestTxClaimsDrainConcurrently: 8 workers drain 20,000 rows of an
// application table with in-transaction claims; every row is processed
// exactly once (times = 1, and by the worker the test recorded) and no worker
// ever waits for a lock: lock_timeout would fail it, and a blocker
// transaction holds 100 rows locked until every worker has finished.
func TestTxClaimsDrainConcurrently(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	dsn := pgtest.DSN(t)
	pool := noWaitPool(t, ctx, dsn, 9)
	const rows, workers, blocked = 20000, 8, 100
	importsTable(t, pool, rows)
	claimer, err := skiplocked.NewTxClaimer(ctx, pool, pendingSpec(100))
	if err != nil {
		t.Fatal(err)
	}
	unblock := holdRows(t, ctx, pool, "SELECT 1 FROM import_rows ORDER BY id LIMIT $1 FOR UPDATE", blocked)

	var mu sync.Mutex
	seen := make(map[int64]string, rows)
	var wg sync.WaitGroup
	errs := make(chan error, workers+1)
	drain := func(name string) {
		for {
			var ids []int64
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				var err error
				ids, err = skiplocked.ClaimTx(ctx, tx, claimer, pgx.RowTo[int64])
				if err != nil || len(ids) == 0 {
					return err
				}
				_, err = tx.Exec(ctx, `UPDATE import_rows SET status = 'done', processed_by = $1, times = times + 1,
						imported_at = now() WHERE id = ANY($2)`, name, ids)
				return err
			})
			if err != nil {
				errs <- fmt.Errorf("%s: %w", name, err)
				return
			}
			if len(ids) == 0 {
				return
			}
			mu.Lock()
			for _, id := range ids {
				if prev, dup := seen[id]; dup {
					errs <- fmt.Errorf("row %d claimed by %s and %s", id, prev, name)
				}
				seen[id] = name
			}
			mu.Unlock()
		}
	}
	for w := range workers {
		name := fmt.Sprintf("w%d", w)
		wg.Go(func() { drain(name) })
	}
	wg.Wait()
	// The workers skipped the blocked rows and stopped; free them and drain
	// the rest with one more worker.
	if len(seen) != rows-blocked {
		t.Errorf("claimed %d rows while %d were locked, want %d", len(seen), blocked, rows-blocked)
	}
	unblock()
	drain("wz")
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if len(seen) != rows {
		t.Fatalf("claimed %d distinct rows, want %d", len(seen), rows)
	}
	var notOnce, mismatched int
	rs, err := pool.Query(ctx, "SELECT id, processed_by, times FROM import_rows")
	if err != nil {
		t.Fatal(err)
	}
	for rs.Next() {
		var id int64
		var by *string
		var times int
		if err := rs.Scan(&id, &by, &times); err != nil {
			t.Fatal(err)
		}
		if times != 1 {
			notOnce++
		}
		if by == nil || *by != seen[id] {
			mismatched++
		}
	}
	if rs.Err() != nil || notOnce != 0 || mismatched != 0 {
		t.Fatalf("rows not processed exactly once: %d, processed_by mismatches: %d, err %v", notOnce, mismatched, rs.Err())
	}
}

// A worker killed mid-transaction (pg_terminate_backend) releases its claimed
// application rows at once; a worker that rolls back releases them too.
func TestTxClaimsReleasedOnKillAndRollback(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	importsTable(t, pool, 20)
	claimer, err := skiplocked.NewTxClaimer(ctx, pool, pendingSpec(10))
	if err != nil {
		t.Fatal(err)
	}
	claimAll := func() []int64 {
		t.Helper()
		c, err := claimer.WithLimit(100)
		if err != nil {
			t.Fatal(err)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		ids, err := skiplocked.ClaimTx(ctx, tx, c, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}

	victim, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close(context.Background())
	tx, err := victim.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	held, err := skiplocked.ClaimTx(ctx, tx, claimer, pgx.RowTo[int64])
	if err != nil || len(held) != 10 || held[0] != 1 {
		t.Fatalf("victim claimed %v, %v", held, err)
	}
	if got := claimAll(); len(got) != 10 || got[0] != 11 {
		t.Fatalf("others claimed %v while victim holds 1..10", got)
	}
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", victim.PgConn().PID()); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(claimAll()) != 20 {
		if time.Now().After(deadline) {
			t.Fatal("rows of the killed worker not released")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := skiplocked.ClaimTx(ctx, tx, claimer, pgx.RowTo[int64]); !errors.Is(err, skiplocked.ErrConnection) {
		t.Fatalf("claim on the killed connection: %v, want ErrConnection", err)
	}

	// Rollback releases at once as well.
	tx2, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ids, err := skiplocked.ClaimTx(ctx, tx2, claimer, pgx.RowTo[int64]); err != nil || len(ids) != 10 {
		t.Fatal(ids, err)
	}
	if got := claimAll(); len(got) != 10 {
		t.Fatalf("others claimed %d, want 10", len(got))
	}
	if err := tx2.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if got := claimAll(); len(got) != 20 {
		t.Fatalf("after rollback others claimed %d, want 20", len(got))
	}
}
