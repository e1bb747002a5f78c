package promobserve_test

import (
	"context"
	"log"
	"net/http"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/pgfence/pgfence/observe/promobserve"
	"github.com/pgfence/pgfence/pglock"
)

// Record pgfence's lease metrics in a Prometheus registry and serve them.
func ExampleNew() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m, err := promobserve.New(reg)
	if err != nil {
		log.Fatal(err)
	}
	locker, err := pglock.New(pool, &pglock.Config{Metrics: m})
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()
	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
}
