package migrations_test

import (
	"context"
	"os"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// TestMain runs the tests and the examples; the examples read DATABASE_URL, as
// an application would, and get an empty database of their own to migrate.
func TestMain(m *testing.M) {
	// Re-executed by TestConcurrentProcesses as a migrator child.
	if dsn := os.Getenv("PGFENCE_MIGRATE_CHILD_DSN"); dsn != "" {
		pool, err := pgxpool.New(context.Background(), dsn)
		if err == nil {
			err = migrations.UpPool(context.Background(), pool)
			pool.Close()
		}
		if err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	pgtest.Main(m, pgtest.ExportEmptyDSN("DATABASE_URL"))
}
