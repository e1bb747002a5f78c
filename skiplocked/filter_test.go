package skiplocked_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// filterBypasses are trusted filters that try to leave the parentheses the
// fragment is wrapped in (so "AND (fragment)" becomes "... AND (x) OR (true)
// OR (x)" and claims every row), end the statement, or hide text from the
// check. Each must be refused with ErrInvalidSpec.
var filterBypasses = []struct{ name, sql string }{
	{"E'' escaped quote", `status = E'\'' ) OR (true) OR ( status = E'\''`},
	{"e'' escaped quote", `status = e'\'' ) OR (true) OR ( status = e'\''`},
	{"backslash quote, standard_conforming_strings off", `status = '\'' ) OR (true) OR ( status = '\''`},
	{"E'' escaped backslash", `status = E'\\' ) OR (true`},
	{"U&'' escape", `status = U&'\0027' ) OR (true) OR ( status = U&'\0027'`},
	{"quote inside a quoted identifier", `"'" = status ) OR (true) OR ( status = "'"`},
	{"double quote inside a string", `status = '"' ) OR (true) OR ( "'"`},
	{"line comment", "true -- ) OR (true"},
	{"line comment at the end", "status = 'done' --"},
	{"block comment", "true /* ) OR (true */"},
	{"nested block comment", "true /* /* */ ) OR (true */"},
	{"block comment end", "true */"},
	{"dollar quote", "status = $$ ) OR (true) OR ( $$"},
	{"tagged dollar quote", "status = $x$'$x$ ) OR (true) OR ( status = $x$'$x$"},
	{"placeholder", "id = $1"},
	{"semicolon", "true; DELETE FROM filter_rows"},
	{"semicolon inside a string", "status = ';'"},
	{"closing first", "true) OR (true"},
	{"close and reopen", ") OR ("},
	{"unbalanced open", "(true"},
	{"unbalanced close", "true)"},
	{"unterminated string", "status = 'pending"},
	{"unterminated string after a doubled quote", "status = 'it''"},
	{"unterminated identifier", `"status = 'x'`},
	{"NUL byte", "true\x00) OR (true"},
	{"invalid UTF-8", "status = '\xff'"},
}

// filterTable creates filter_rows: ids 1-5 pending, 6-10 done, 11 it's,
// 12 ")"; columns named ' and ) (NULL) let fragments that quote them parse.
func filterTable(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	if _, err := pool.Exec(ctxT(t), `
		CREATE TABLE filter_rows (id int PRIMARY KEY, status text NOT NULL, "'" text, ")" text);
		INSERT INTO filter_rows SELECT g, CASE WHEN g <= 5 THEN 'pending' ELSE 'done' END FROM generate_series(1, 10) g;
		INSERT INTO filter_rows VALUES (11, 'it''s'), (12, ')')`); err != nil {
		t.Fatal(err)
	}
}

// claimIDs claims with c in a transaction it rolls back, and returns the
// claimed ids in order.
func claimIDs(t *testing.T, ctx context.Context, pool *pgxpool.Pool, c *skiplocked.TxClaimer) []int32 {
	t.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	ids, err := skiplocked.ClaimTx(ctx, tx, c, pgx.RowTo[int32])
	if err != nil {
		t.Fatalf("claim with %s: %v", c.SQL(), err)
	}
	slices.Sort(ids)
	return ids
}

// TestTrustedFilterBypass: the reported bypass claims rows outside the
// filter when pasted as the old check allowed; every bypass attempt is now
// refused with ErrInvalidSpec before any statement runs, and the table and
// its row locks are as before.
func TestTrustedFilterBypass(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	filterTable(t, pool)
	spec := func(filter string) skiplocked.Spec {
		return skiplocked.Spec{
			Table: "filter_rows", Key: []string{"id"},
			Where:            []skiplocked.Cond{{Column: "status", Op: skiplocked.OpEq, Value: "pending"}},
			TrustedFilterSQL: filter, OrderBy: []skiplocked.Order{{Column: "id"}}, Limit: 100,
		}
	}

	// The statement the old check let through: on this server it claims
	// the done rows too.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rows, _ := tx.Query(ctx, `SELECT "id" FROM "filter_rows" WHERE "status" = $1 AND (`+filterBypasses[0].sql+
		`) ORDER BY "id" LIMIT $2 FOR UPDATE SKIP LOCKED`, "pending", 100)
	leaked, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	_ = tx.Rollback(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(leaked) != 12 {
		t.Fatalf("the bypass claimed %v; the test expects it to claim all 12 rows", leaked)
	}

	for _, b := range filterBypasses {
		c, err := skiplocked.NewTxClaimer(ctx, pool, spec(b.sql))
		if !errors.Is(err, skiplocked.ErrInvalidSpec) {
			sql := ""
			if c != nil {
				sql = c.SQL()
			}
			t.Errorf("%s: %q: err = %v, want ErrInvalidSpec (statement %s)", b.name, b.sql, err, sql)
			continue
		}
		if c != nil {
			t.Errorf("%s: a claimer came back with the error", b.name)
		}
	}

	// Nothing changed, nothing is left locked: a claim of the pending rows
	// takes all five.
	c, err := skiplocked.NewTxClaimer(ctx, pool, spec(""))
	if err != nil {
		t.Fatal(err)
	}
	if got := claimIDs(t, ctx, pool, c); !slices.Equal(got, []int32{1, 2, 3, 4, 5}) {
		t.Fatalf("pending claim after the refusals: %v", got)
	}
	var pending, done int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'done')
		FROM filter_rows`).Scan(&pending, &done); err != nil || pending != 5 || done != 5 {
		t.Fatalf("rows: %d pending, %d done, %v", pending, done, err)
	}
}

// TestTrustedFilterQuoting: fragments with quotes and parentheses inside
// literals and identifiers are accepted and select exactly the rows they say.
func TestTrustedFilterQuoting(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	filterTable(t, pool)
	for _, tc := range []struct {
		sql  string
		want []int32
	}{
		{`status = 'it''s'`, []int32{11}},
		{`status = E'it''s'`, []int32{11}},
		{`status = ')'`, []int32{12}},
		{`"status" = ')' OR status = '('`, []int32{12}},
		{`status IN ('pending', ')') AND (id % 2) = 0`, []int32{2, 4, 12}},
		{`status <> 'done' AND "id" > 10`, []int32{11, 12}},
		{`status = '"'`, nil},
		{`status = '' OR status = ''''`, nil},
		{`U&"st!0061tus" UESCAPE '!' = 'it''s'`, []int32{11}},
		{"status = 'pending'\n  AND id <= 2", []int32{1, 2}},
		{`((id > 3)) AND (id < 6)`, []int32{4, 5}},
	} {
		c, err := skiplocked.NewTxClaimer(ctx, pool, skiplocked.Spec{
			Table: "filter_rows", Key: []string{"id"}, TrustedFilterSQL: tc.sql, Limit: 100,
		})
		if err != nil {
			t.Errorf("%q refused: %v", tc.sql, err)
			continue
		}
		if got := claimIDs(t, ctx, pool, c); !slices.Equal(got, tc.want) {
			t.Errorf("%q claimed %v, want %v", tc.sql, got, tc.want)
		}
	}
}

// TestTrustedFilterConfinedByPostgres asks PostgreSQL whether the fragments
// the check accepts stay inside their parentheses: random fragments made of
// literals, quoted identifiers, stray quotes and parentheses, OR and true are
// pasted into "SELECT count(*) FROM filter_rows WHERE false AND (fragment)". A fragment that stays inside
// returns no row (or fails to parse); one that escapes its parentheses can
// return a row.
func TestTrustedFilterConfinedByPostgres(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	filterTable(t, pool)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	tokens := []string{ // the first 11 are literals and identifiers
		"'x'", "'it''s'", "E'x'", "U&'x'", `'"'`, "')'", "'('", "status", `"status"`, `"'"`, `")"`,
		"=", "<>", " AND ", " OR ", "true", "false", "(", ")", ")", " ", "'", `"`, "''", `""`,
	}
	r := rand.New(rand.NewPCG(1, 2))
	accepted, parsed := 0, 0
	// Half the fragments are random token strings; half fill the shape of
	// the reported bypass, "A = B ) OR (true) OR ( C = D", with random
	// literals and identifiers, which escapes whenever a check miscounts
	// the quotes around the parentheses.
	atoms := tokens[:11]
	for i := range 4000 {
		var b strings.Builder
		if i%2 == 0 {
			for range 1 + r.IntN(12) {
				b.WriteString(tokens[r.IntN(len(tokens))])
			}
		} else {
			pick := func() string { return atoms[r.IntN(len(atoms))] }
			b.WriteString(pick() + " = " + pick() + " ) OR (true) OR ( " + pick() + " = " + pick())
		}
		frag := b.String()
		if _, err := skiplocked.NewTxClaimer(ctx, pool, skiplocked.Spec{
			Table: "filter_rows", Key: []string{"id"}, TrustedFilterSQL: frag, Limit: 1,
		}); err != nil {
			if !errors.Is(err, skiplocked.ErrInvalidSpec) {
				t.Fatalf("%q: untyped error %v", frag, err)
			}
			continue
		}
		accepted++
		var n int
		err := conn.QueryRow(ctx, "SELECT count(*) FROM filter_rows WHERE false AND ("+frag+")", pgx.QueryExecModeSimpleProtocol).Scan(&n)
		if err != nil {
			continue // does not parse or does not type-check: it would fail, not leak
		}
		parsed++
		if n != 0 {
			t.Errorf("%q was accepted and escapes its parentheses", frag)
		}
	}
	t.Logf("4000 random fragments: %d accepted, %d of them valid SQL, none escaped", accepted, parsed)
	if parsed == 0 {
		t.Fatal("no accepted fragment was valid SQL: the corpus tests nothing")
	}
}
