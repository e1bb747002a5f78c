package fencedwrite

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DBTX is what the helpers need from a connection: *pgxpool.Pool, *pgx.Conn
// and pgx.Tx all satisfy it, so a fenced write runs on a pool or inside the
// caller's transaction. It is the same shape as the DBTX of sqlc's pgx/v5
// output.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Beginner starts a transaction: *pgxpool.Pool, *pgx.Conn and pgx.Tx (a
// savepoint) satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}
