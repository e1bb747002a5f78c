// Package exporter reports pgfence's database-side state as Prometheus metrics:
// what the lock table and the job queue look like right now, read on each
// scrape with the database's clock. It is served by `pgfence exporter`.
package exporter

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
)

// Collector queries pgfence's tables on every scrape.
type Collector struct {
	pool    *pgxpool.Pool
	timeout time.Duration

	up             *prometheus.Desc
	locks          *prometheus.Desc
	expiredMax     *prometheus.Desc
	heldSinceGrant *prometheus.Desc
	maxToken       *prometheus.Desc
	jobs           *prometheus.Desc
	oldestClaim    *prometheus.Desc
	oldestReady    *prometheus.Desc
}

// New returns a collector over pool. Each scrape runs a few aggregate queries
// bounded by timeout (default 5s when timeout <= 0).
func New(pool *pgxpool.Pool, timeout time.Duration) *Collector {
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	return &Collector{
		pool:    pool,
		timeout: timeout,
		up: prometheus.NewDesc("pgfence_up",
			"1 if the last scrape could read pgfence's tables, else 0.", nil, nil),
		locks: prometheus.NewDesc("pgfence_locks",
			"Lock rows by state on the database clock: held, expired (lease ran out without release), free.", []string{"state"}, nil),
		expiredMax: prometheus.NewDesc("pgfence_lock_expired_seconds_max",
			"Seconds since the longest-expired unreleased lease ran out (0 if none): a holder that died or was paused.", nil, nil),
		heldSinceGrant: prometheus.NewDesc("pgfence_lock_held_since_grant_seconds_max",
			"Longest time since the grant among held leases: compare with the TTL to spot leases renewed far beyond it.", nil, nil),
		maxToken: prometheus.NewDesc("pgfence_lock_token_max",
			"Highest fencing token in the lock table (tokens never go down; overflow is at 9223372036854775807).", nil, nil),
		jobs: prometheus.NewDesc("pgfence_jobs",
			"Rows of pgfence.jobs by queue and state.", []string{"queue", "state"}, nil),
		oldestClaim: prometheus.NewDesc("pgfence_jobs_claim_expired_seconds_max",
			"Per queue, seconds since the oldest expired claim ran out (a stuck or dead worker); 0 if none.", []string{"queue"}, nil),
		oldestReady: prometheus.NewDesc("pgfence_jobs_ready_age_seconds_max",
			"Per queue, age in seconds of the oldest job that is ready to run but not claimed (queue latency).", []string{"queue"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.up, c.locks, c.expiredMax, c.heldSinceGrant, c.maxToken, c.jobs, c.oldestClaim, c.oldestReady} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	if err := c.collectLocks(ctx, ch); err != nil {
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0)
		return
	}
	if err := c.collectJobs(ctx, ch); err != nil {
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 1)
}

func (c *Collector) collectLocks(ctx context.Context, ch chan<- prometheus.Metric) error {
	var held, expired, free int64
	var expiredMax, heldMax float64
	var maxToken int64
	err := c.pool.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE holder IS NOT NULL AND expires_at > now()),
		       count(*) FILTER (WHERE holder IS NOT NULL AND expires_at <= now()),
		       count(*) FILTER (WHERE holder IS NULL),
		       COALESCE(max(extract(epoch FROM now() - expires_at)) FILTER (WHERE holder IS NOT NULL AND expires_at <= now()), 0)::float8,
		       COALESCE(max(extract(epoch FROM now() - acquired_at)) FILTER (WHERE holder IS NOT NULL AND expires_at > now()), 0)::float8,
		       COALESCE(max(token), 0)
		FROM pgfence.locks`).Scan(&held, &expired, &free, &expiredMax, &heldMax, &maxToken)
	if err != nil {
		return err
	}
	ch <- prometheus.MustNewConstMetric(c.locks, prometheus.GaugeValue, float64(held), "held")
	ch <- prometheus.MustNewConstMetric(c.locks, prometheus.GaugeValue, float64(expired), "expired")
	ch <- prometheus.MustNewConstMetric(c.locks, prometheus.GaugeValue, float64(free), "free")
	ch <- prometheus.MustNewConstMetric(c.expiredMax, prometheus.GaugeValue, expiredMax)
	ch <- prometheus.MustNewConstMetric(c.heldSinceGrant, prometheus.GaugeValue, heldMax)
	ch <- prometheus.MustNewConstMetric(c.maxToken, prometheus.GaugeValue, float64(maxToken))
	return nil
}

// collectJobs reports pgfence.jobs when the table exists (its migration may
// not be applied on every database).
func (c *Collector) collectJobs(ctx context.Context, ch chan<- prometheus.Metric) error {
	var present bool
	if err := c.pool.QueryRow(ctx, "SELECT to_regclass('pgfence.jobs') IS NOT NULL").Scan(&present); err != nil {
		return err
	}
	if !present {
		return nil
	}
	rows, err := c.pool.Query(ctx, `
		SELECT queue, state, count(*)::float8,
		       COALESCE(max(extract(epoch FROM now() - claim_expires_at))
		                FILTER (WHERE state = 'running' AND claim_expires_at <= now()), 0)::float8,
		       COALESCE(max(extract(epoch FROM now() - run_at))
		                FILTER (WHERE state = 'available' AND run_at <= now()), 0)::float8
		FROM pgfence.jobs
		GROUP BY queue, state
		ORDER BY queue, state`)
	if err != nil {
		return err
	}
	defer rows.Close()
	claim := map[string]float64{}
	ready := map[string]float64{}
	for rows.Next() {
		var queue, state string
		var n, expired, age float64
		if err := rows.Scan(&queue, &state, &n, &expired, &age); err != nil {
			return err
		}
		ch <- prometheus.MustNewConstMetric(c.jobs, prometheus.GaugeValue, n, queue, state)
		claim[queue] = max(claim[queue], expired)
		ready[queue] = max(ready[queue], age)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	for q, v := range claim {
		ch <- prometheus.MustNewConstMetric(c.oldestClaim, prometheus.GaugeValue, v, q)
	}
	for q, v := range ready {
		ch <- prometheus.MustNewConstMetric(c.oldestReady, prometheus.GaugeValue, v, q)
	}
	return nil
}
