package faultsuite

import (
	"context"
	"net/url"
	"os"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
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

// withParams adds query parameters (key, value pairs) to a URL-form DSN,
// whether or not it already has a query string.
func withParams(t testing.TB, dsn string, kv ...string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatalf("DSN %q: %v", dsn, err)
	}
	q := u.Query()
	for i := 0; i+1 < len(kv); i += 2 {
		q.Set(kv[i], kv[i+1])
	}
	u.RawQuery = q.Encode()
	return u.String()
}
