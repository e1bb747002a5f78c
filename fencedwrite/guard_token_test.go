package fencedwrite_test

import (
	"context"
	"errors"
	"testing"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestGuardRefusalCarriesToken: a guard's refusal of a superseded holder
// (PF008, ErrStaleToken) and of a token never issued (PF002) carries the
// token refused in Error.Token, as the error table of docs/fencedwrite.md
// says; it was 0.
func TestGuardRefusalCarriesToken(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	if err := fencedwrite.Guard(ctx, pool, "invoices", fencedwrite.GuardOptions{LockName: "l"}); err != nil {
		t.Fatal(err)
	}
	tok := grant(t, pool, "l")
	latest := grant(t, pool, "l")
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"status"}})
	for _, c := range []struct {
		token int64
		kind  error
	}{
		{tok, pgfence.ErrStaleToken},     // superseded (PF008)
		{latest + 5, pgfence.ErrInvalid}, // never issued (PF002)
	} {
		_, err := tbl.Update(ctx, pool, c.token, []any{2}, []any{"x"})
		var pe *pgfence.Error
		if !errors.As(err, &pe) || !errors.Is(err, c.kind) || pe.Token != c.token {
			t.Errorf("guarded Update with token %d: %v (Token %d); want %v with Token %d", c.token, err, tokenOf(pe), c.kind, c.token)
		}
	}
}

func tokenOf(pe *pgfence.Error) int64 {
	if pe == nil {
		return 0
	}
	return pe.Token
}

// TestGuardRefusalTokenNotFromKey: the token is read from the refusal's
// message, not from its DETAIL, which begins with the row's key: a key
// holding text that reads like a token gave Error.Token a number the write
// never carried.
func TestGuardRefusalTokenNotFromKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE acct (id text PRIMARY KEY, v text, fence bigint NOT NULL DEFAULT 0)`)
	const key = `a, row fence 0, token 77, b`
	mustExec(t, pool, `INSERT INTO acct (id) VALUES ($1)`, key)
	if err := fencedwrite.Guard(ctx, pool, "acct", fencedwrite.GuardOptions{LockName: "l"}); err != nil {
		t.Fatal(err)
	}
	tok := grant(t, pool, "l")
	grant(t, pool, "l")
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "acct", Key: []string{"id"}, Set: []string{"v"}})
	_, err := tbl.Update(ctx, pool, tok, []any{key}, []any{"x"})
	var pe *pgfence.Error
	if !errors.As(err, &pe) || !errors.Is(err, pgfence.ErrStaleToken) {
		t.Fatalf("want stale: %v", err)
	}
	t.Logf("reason: %s", pe.Reason)
	if pe.Token != tok {
		t.Errorf("Error.Token = %d, want %d (the token the write carried)", pe.Token, tok)
	}
}
