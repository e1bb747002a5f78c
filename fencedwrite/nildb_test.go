package fencedwrite_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
)

// Every call that takes a database handle refuses a nil one (untyped, or a
// typed nil pool inside the interface) with pgfence.ErrInvalid naming db instead of panicking.
func TestNilDatabaseHandle(t *testing.T) {
	ctx := context.Background()
	var pool *pgxpool.Pool
	value := []byte(`{"a":1}`)
	for _, db := range []pgfence.DBTX{nil, pool} {
		calls := map[string]error{}
		_, calls["UpdateValue"] = fencedwrite.UpdateValue(ctx, db, 1, fencedwrite.Strict, "k", value)
		_, calls["UpsertValue"] = fencedwrite.UpsertValue(ctx, db, 1, fencedwrite.Strict, "k", value)
		_, calls["DeleteValue"] = fencedwrite.DeleteValue(ctx, db, 1, "k")
		_, calls["ReadValue"] = fencedwrite.ReadValue(ctx, db, 1, "k")
		_, calls["GetValue"] = fencedwrite.GetValue(ctx, db, "k")
		_, calls["Prepare"] = fencedwrite.Prepare(ctx, db, fencedwrite.Spec{Table: "t", Key: []string{"id"}, Set: []string{"v"}})
		calls["Guard"] = fencedwrite.Guard(ctx, db, "t", fencedwrite.GuardOptions{LockName: "l"})
		_, calls["Unguard"] = fencedwrite.Unguard(ctx, db, "t")
		_, calls["ListGuarded"] = fencedwrite.ListGuarded(ctx, db)
		for name, err := range calls {
			if !matches(err, invalidArg("db")) {
				t.Errorf("%s(%T nil) = %v, want ErrInvalid naming db", name, db, err)
			}
		}
	}
	var beginner fencedwrite.Beginner
	if _, err := fencedwrite.ModifyValue(ctx, beginner, 1, "k", keep); !matches(err, invalidArg("db")) {
		t.Errorf("ModifyValue(nil) = %v, want ErrInvalid naming db", err)
	}
	var tx pgx.Tx
	if _, err := fencedwrite.ModifyValue(ctx, tx, 1, "k", keep); !matches(err, invalidArg("db")) {
		t.Errorf("ModifyValue(nil tx) = %v, want ErrInvalid naming db", err)
	}
}

func keep(v json.RawMessage) (json.RawMessage, error) { return v, nil }
