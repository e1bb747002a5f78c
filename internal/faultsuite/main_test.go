package faultsuite

import (
	"context"
	"os"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// long reports whether the long forms were asked for (PGFENCE_FAULTS_LONG=1).
func long() bool {
	v, _ := strconv.ParseBool(os.Getenv("PGFENCE_FAULTS_LONG"))
	return v
}

// bigPool opens a pool of up to n connections on dsn, closed when t ends.
func bigPool(t *testing.T, dsn string, n int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = n
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}
