package fencedwrite_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestValuesMissingSchema: on a database nobody migrated, every value
// function says the schema is missing and what to run.
func TestValuesMissingSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.PoolFor(t, pgtest.EmptyDSN(t))
	v := json.RawMessage(`1`)
	_, err := fencedwrite.UpsertValue(ctx, pool, 1, fencedwrite.Strict, "k", v)
	pgtest.WantSchemaHint(t, "UpsertValue", err)
	_, err = fencedwrite.UpdateValue(ctx, pool, 1, fencedwrite.Strict, "k", v)
	pgtest.WantSchemaHint(t, "UpdateValue", err)
	_, err = fencedwrite.DeleteValue(ctx, pool, 1, "k")
	pgtest.WantSchemaHint(t, "DeleteValue", err)
	_, err = fencedwrite.ReadValue(ctx, pool, 1, "k")
	pgtest.WantSchemaHint(t, "ReadValue", err)
	_, err = fencedwrite.GetValue(ctx, pool, "k")
	pgtest.WantSchemaHint(t, "GetValue", err)
	_, err = fencedwrite.ModifyValue(ctx, pool, 1, "k", func(json.RawMessage) (json.RawMessage, error) { return v, nil })
	pgtest.WantSchemaHint(t, "ModifyValue", err)
}
