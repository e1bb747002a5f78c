package migrations_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/migrations"
)

// guardReentrantLatestVersion is the version of migration
// 00015_pgfence_guard_reentrant_latest.sql, from which a reentrant guard
// checks a fence kept equal against the lock's latest token.
const guardReentrantLatestVersion = 15

// TestGuardReentrantLatest: the guards attached at version 14 are attached
// again by migration 00015. The only changes that end otherwise are UPDATEs
// of reentrant tables that keep the fence, which version 14 accepted without
// reading the lock: after 00015 one keeping a superseded token is PF008, one
// keeping a token the lock never issued PF002, and one keeping fence 0 (no
// token) PF001; one keeping the lock's latest token still passes. Strict
// guards, and everything else, decide as before; the Down gives version 14's
// decisions back.
func TestGuardReentrantLatest(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	pool, db, _, reentrant, statements := markWhenSetup(t, ctx, "guard_reentrant_latest", guardReentrantLatestVersion)
	before := fmt.Sprintf("version %d", guardReentrantLatestVersion-1)
	after := fmt.Sprintf("version %d", guardReentrantLatestVersion)
	// gc:one's latest token is 10 (rows 1 and 2 keep 10 and 7); gc:none has
	// no lock row (row 4 keeps 5); row 3 keeps 0.
	extra := []guardCostTx{
		{"gc_fixed_reentrant", []string{"UPDATE gc_fixed_reentrant SET fence = fence WHERE id = 1"}},
		{"gc_fixed_reentrant", []string{"UPDATE gc_fixed_reentrant SET v = v + 1, fence = 7 WHERE id = 2 AND fence <= 7"}},
	}
	statements = append(statements, extra...)
	beforeOutcomes := guardOutcomes(t, ctx, pool, statements)

	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, guardReentrantLatestVersion); err != nil {
		t.Fatal(err)
	}
	afterOutcomes := guardOutcomes(t, ctx, pool, statements)
	refusedNow := map[string]int{}
	for i, s := range statements {
		b, a := beforeOutcomes[i], afterOutcomes[i]
		if a == b {
			continue
		}
		sql := strings.Join(s.sql, "; ")
		code, _, _ := strings.Cut(strings.TrimPrefix(a, "ERR "), " ")
		switch {
		case !reentrant[s.table]:
			t.Errorf("%q on a strict guard:\n  %s: %s\n  %s: %s", sql, before, b, after, a)
		case !strings.HasPrefix(b, "OK") || !strings.HasPrefix(a, "ERR PF"):
			t.Errorf("%q: not a change accepted before and refused now:\n  %s: %s\n  %s: %s", sql, before, b, after, a)
		case code != "PF008" && code != "PF002" && code != "PF001":
			t.Errorf("%q refused with %s: %s", sql, code, a)
		default:
			refusedNow[code]++
		}
	}
	t.Logf("refused from %s on: %v", after, refusedNow)
	for _, code := range []string{"PF008", "PF002", "PF001"} {
		if refusedNow[code] == 0 {
			t.Errorf("no kept fence refused with %s after %s: the scenario does not exercise it", code, after)
		}
	}
	for i, want := range []string{"OK", "ERR PF008"} {
		if got := afterOutcomes[len(statements)-len(extra)+i]; !strings.HasPrefix(got, want) {
			t.Errorf("%q at %s: %s, want %s", extra[i].sql[0], after, got, want)
		}
	}

	if err := migrations.DownTo(ctx, db, guardReentrantLatestVersion-1); err != nil {
		t.Fatal(err)
	}
	compareOutcomes(t, before, beforeOutcomes, before+" again", guardOutcomes(t, ctx, pool, statements), statements)
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
}
