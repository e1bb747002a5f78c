package migrations_test

import (
	"context"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// TestGuardMarkWhenOtherOwner: the schema is migrated by an owner that is
// not a superuser (CREATE on the database, as docs/migrations.md asks), and
// one guarded table changed owner after its guard was attached. Migration
// 00011 cannot create that table's mark trigger again: the Up gives the WHEN
// clause to the guard it may change and leaves the other one as it was, with
// one WARNING naming it, and both guards refuse and accept exactly what they
// did before. The Down does the same the other way round: a table the owner
// may no longer change keeps its clause (WARNING), and a trigger the Up left
// alone is not touched again. Migration 00013, which takes the clause away,
// is checked the same way in between.
func TestGuardMarkWhenOtherOwner(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dsn := pgtest.EmptyDSN(t)
	admin := pgtest.PoolFor(t, dsn)
	owner, ownerID := tempRole(t, ctx, admin, dsn, "pgfence_mw_owner")
	_, otherID := tempRole(t, ctx, admin, dsn, "pgfence_mw_other")
	mustExecPool(t, ctx, admin, "ALTER ROLE "+ownerID+" LOGIN NOSUPERUSER")
	mustExecPool(t, ctx, admin, `DO $$ BEGIN EXECUTE format('GRANT CREATE ON DATABASE %I TO `+ownerID+`', current_database()); END $$`)
	mustExecPool(t, ctx, admin, "GRANT CREATE ON SCHEMA public TO "+ownerID)

	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(owner)
	pool, takeWarnings := warningPool(t, ctx, u.String())
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	if queryString(t, ctx, pool, "SELECT rolsuper::text FROM pg_roles WHERE rolname = current_user") != "false" {
		t.Fatal("the owner of this test is a superuser: it would not exercise the refusal")
	}

	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, guardMarkWhenVersion-1); err != nil {
		t.Fatalf("migrate to version %d as an owner that is not a superuser: %v", guardMarkWhenVersion-1, err)
	}
	mustExecPool(t, ctx, pool, `INSERT INTO pgfence.locks (name, token) VALUES ('gc:one', 10), ('gc:two', 20)`)
	const (
		kept  = "mw_kept_reentrant"
		moved = "mw_moved_reentrant"
	)
	tables := []string{kept, moved}
	var statements []guardCostTx
	for _, tb := range guardCostTables {
		if tb.name != "gc_column_reentrant_null" && tb.name != "gc_expression_reentrant" {
			continue
		}
		name := kept
		if tb.name == "gc_expression_reentrant" {
			name = moved
		}
		guardCostTable(t, ctx, pool, name, tb.ddl, tb.guard)
		for _, s := range guardCostStatements() {
			if s.table == tb.name {
				sql := slices.Clone(s.sql)
				for i := range sql {
					sql[i] = strings.ReplaceAll(sql[i], tb.name, name)
				}
				statements = append(statements, guardCostTx{name, sql})
			}
		}
	}
	// After the guard was attached, the table changed owner.
	mustExecPool(t, ctx, admin, "ALTER TABLE "+moved+" OWNER TO "+otherID)

	before := "version 10, all tables the owner's but one"
	checkMarkWhen(t, ctx, admin, before, tables, func(string) bool { return false })
	beforeOutcomes := guardOutcomes(t, ctx, admin, statements)

	if _, err := p.UpTo(ctx, guardMarkWhenVersion); err != nil {
		t.Fatalf("migration %d as the owner, one guarded table not its own: %v", guardMarkWhenVersion, err)
	}
	after := "after the Up, one table not the owner's"
	if w := takeWarnings(); len(w) != 1 || !strings.Contains(w[0], moved) ||
		!strings.Contains(w[0], "keeps its mark trigger without a WHEN clause") {
		t.Errorf("warnings of the Up: %q, want one for %s", w, moved)
	}
	checkMarkWhen(t, ctx, admin, after, tables, func(tb string) bool { return tb == kept })
	compareOutcomes(t, before, beforeOutcomes, after, guardOutcomes(t, ctx, admin, statements), statements)

	// Now the other table changes owner too. Migration 00013 takes the
	// clause away again: it may not change kept's trigger (WARNING) and has
	// nothing to do for moved's; its Down may not give moved the clause
	// (WARNING) and leaves kept's alone.
	mustExecPool(t, ctx, admin, "ALTER TABLE "+kept+" OWNER TO "+otherID)
	if _, err := p.UpTo(ctx, guardMarkAlwaysVersion); err != nil {
		t.Fatalf("migration %d as the owner, no guarded table its own: %v", guardMarkAlwaysVersion, err)
	}
	always := "after 00013's Up, no table the owner's"
	if w := takeWarnings(); len(w) != 1 || !strings.Contains(w[0], kept) ||
		!strings.Contains(w[0], "keeps its mark trigger with its WHEN clause") {
		t.Errorf("warnings of 00013's Up: %q, want one for %s", w, kept)
	}
	checkMarkWhen(t, ctx, admin, always, tables, func(tb string) bool { return tb == kept })
	compareOutcomes(t, before, beforeOutcomes, always, guardOutcomes(t, ctx, admin, statements), statements)
	if err := migrations.DownTo(ctx, db, guardMarkWhenVersion); err != nil {
		t.Fatalf("Down of %d as the owner, no guarded table its own: %v", guardMarkAlwaysVersion, err)
	}
	if w := takeWarnings(); len(w) != 1 || !strings.Contains(w[0], moved) ||
		!strings.Contains(w[0], "keeps its mark trigger without a WHEN clause") {
		t.Errorf("warnings of 00013's Down: %q, want one for %s (and none for %s, whose trigger has the clause)", w, moved, kept)
	}
	checkMarkWhen(t, ctx, admin, always+" and its Down", tables, func(tb string) bool { return tb == kept })

	// The owner rolls back 00011.
	if err := migrations.DownTo(ctx, db, guardMarkWhenVersion-1); err != nil {
		t.Fatalf("Down of %d as the owner, no guarded table its own: %v", guardMarkWhenVersion, err)
	}
	down := "after the Down, no table the owner's"
	if w := takeWarnings(); len(w) != 1 || !strings.Contains(w[0], kept) ||
		!strings.Contains(w[0], "keeps its mark trigger with its WHEN clause") {
		t.Errorf("warnings of the Down: %q, want one for %s (and none for %s, whose trigger has no WHEN clause)", w, kept, moved)
	}
	checkMarkWhen(t, ctx, admin, down, tables, func(tb string) bool { return tb == kept })
	compareOutcomes(t, before, beforeOutcomes, down, guardOutcomes(t, ctx, admin, statements), statements)
}
