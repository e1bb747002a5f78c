package fencegen_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/cmd/pgfence/internal/fencegen"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestGeneratedRefusesTokenNotPositive: every generated statement refuses a
// token of 0 or below with PF007 and changes nothing. A Params struct whose
// Token is left unset holds 0: the re-entrant update and the read matched
// every row whose fence was still 0 (fence <= 0), and the upsert inserted a
// new key with that token as its fence, each reporting success.
func TestGeneratedRefusesTokenNotPositive(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	for _, s := range []string{
		`CREATE TABLE acct (id bigint PRIMARY KEY, balance bigint NOT NULL, fence bigint NOT NULL DEFAULT 0)`,
		`INSERT INTO acct (id, balance) VALUES (1, 100), (2, 100)`,
		`CREATE TABLE pacct (id bigint, region text, balance bigint NOT NULL, fence bigint NOT NULL DEFAULT 0,
		   PRIMARY KEY (id, region)) PARTITION BY LIST (region)`,
		`CREATE TABLE pacct_eu PARTITION OF pacct FOR VALUES IN ('eu')`,
		`INSERT INTO pacct (id, region, balance) VALUES (1, 'eu', 100)`,
	} {
		if _, err := pool.Exec(ctx, s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
	rows := func(table string) string {
		t.Helper()
		var s string
		if err := pool.QueryRow(ctx, `SELECT string_agg(id || ':' || balance || ':' || fence, ' ' ORDER BY id) FROM `+table).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	opts := fencegen.Options{Table: "acct", Key: []string{"id"}, Set: []string{"balance"}, HasFenceColumn: true, Version: "00002"}
	popts := fencegen.Options{Table: "pacct", Key: []string{"id", "region"}, Set: []string{"balance"}, HasFenceColumn: true,
		Version: "00002", Partitioned: true}
	for _, token := range []int64{0, -5} {
		for _, c := range []struct {
			opts   fencegen.Options
			name   string
			params []string
			args   []any
		}{
			{opts, "FencedUpdateAcct", []string{"token", "id", "balance"}, []any{token, int64(1), int64(5)}},
			{opts, "FencedUpdateAcctReentrant", []string{"token", "id", "balance"}, []any{token, int64(1), int64(5)}},
			{opts, "FencedUpsertAcct", []string{"token", "id", "balance"}, []any{token, int64(1), int64(5)}},
			{opts, "FencedUpsertAcct", []string{"token", "id", "balance"}, []any{token, int64(10), int64(5)}},
			{opts, "FencedReadAcct", []string{"token", "id"}, []any{token, int64(2)}},
			{opts, "FencedDeleteAcct", []string{"token", "id"}, []any{token, int64(2)}},
			{popts, "FencedUpdatePacctReentrant", []string{"token", "id", "region", "balance"}, []any{token, int64(1), "eu", int64(5)}},
			{popts, "FencedUpsertPacct", []string{"token", "id", "region", "balance"}, []any{token, int64(1), "eu", int64(5)}},
			{popts, "FencedUpsertPacct", []string{"token", "id", "region", "balance"}, []any{token, int64(10), "eu", int64(5)}},
			{popts, "FencedReadPacct", []string{"token", "id", "region"}, []any{token, int64(1), "eu"}},
		} {
			_, err := pool.Exec(ctx, generatedStatement(t, c.opts, c.name, c.params...), c.args...)
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != "PF007" {
				t.Errorf("%s%v = %v; want SQLSTATE PF007 (invalid token)", c.name, c.args, err)
			}
		}
	}
	if got := rows("acct"); got != "1:100:0 2:100:0" {
		t.Errorf("acct after the refused writes: %s; want 1:100:0 2:100:0 (unchanged)", got)
	}
	if got := rows("pacct"); got != "1:100:0" {
		t.Errorf("pacct after the refused writes: %s; want 1:100:0 (unchanged)", got)
	}
}
