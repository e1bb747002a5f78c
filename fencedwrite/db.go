package fencedwrite

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// Beginner starts a transaction: *pgxpool.Pool, *pgx.Conn and pgx.Tx (a
// savepoint) satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}
