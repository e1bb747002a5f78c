package exporter

import (
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"

	"github.com/pgfence/pgfence/internal/dbsqlc"
)

// snapshot is what one collection read, in one transaction.
type snapshot struct {
	locks   dbsqlc.ExporterLockStatsRow
	hasJobs bool
	queues  []dbsqlc.ExporterQueueStatsRow
	hasDead bool
	dead    []dbsqlc.ExporterDeadCountsRow
}

func (e *Exporter) collect(ctx context.Context) (*snapshot, error) {
	// One read-only REPEATABLE READ transaction: every number comes from the
	// same snapshot, and SET LOCAL-style settings end with it.
	tx, err := e.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return nil, fmt.Errorf("begin: %w", err)
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = tx.Rollback(rctx)
	}()
	limit := e.opts.Timeout
	if dl, ok := ctx.Deadline(); ok {
		limit = time.Until(dl)
	}
	ms := strconv.FormatInt(max(limit.Milliseconds(), 1), 10)
	if _, err := tx.Exec(ctx, "SELECT pg_catalog.set_config('statement_timeout', $1, true), pg_catalog.set_config('lock_timeout', $1, true)", ms); err != nil {
		return nil, fmt.Errorf("set timeouts: %w", err)
	}
	tables, err := e.q.ExporterTables(ctx, tx)
	if err != nil {
		return nil, fmt.Errorf("tables: %w", err)
	}
	s := &snapshot{hasJobs: tables.Jobs, hasDead: tables.DeadCounts}
	if s.locks, err = e.q.ExporterLockStats(ctx, tx); err != nil {
		return nil, fmt.Errorf("pgfence.locks: %w", err)
	}
	top := int64(e.opts.TopQueues)
	if s.hasJobs {
		if s.queues, err = e.q.ExporterQueueStats(ctx, tx, OtherQueue, top); err != nil {
			return nil, fmt.Errorf("pgfence.jobs: %w", err)
		}
	}
	if s.hasDead {
		if s.dead, err = e.q.ExporterDeadCounts(ctx, tx, top); err != nil {
			return nil, fmt.Errorf("pgfence.job_dead_counts: %w", err)
		}
	}
	return s, nil
}

// Def describes one metric the exporter serves.
type Def struct {
	Name   string   // metric name, as served
	Type   string   // "gauge" or "counter", as in the exposition's TYPE line
	Help   string   // the HELP line
	Labels []string // label names
}

// Catalog lists every metric the exporter serves.
// Dashboards and alert rules may use these names (and observe.Catalog's).
var Catalog = []Def{
	{"pgfence_up", "gauge", "1 if the collection served could read pgfence's tables, else 0 (the exporter's log says why).", nil},
	{"pgfence_locks", "gauge", "Lock rows by state on the database clock: held, expired (lease ran out without release), free.", []string{"state"}},
	{"pgfence_lock_expired_seconds_max", "gauge", "Seconds since the longest-expired unreleased lease ran out (0 if none): a holder that died or was paused.", nil},
	{"pgfence_lock_held_since_grant_seconds_max", "gauge", "Longest time since the grant among held leases: compare with the TTL to spot leases renewed far beyond it.", nil},
	{"pgfence_lock_token_max", "gauge", "Highest fencing token in the lock table (tokens never go down; overflow is at 9223372036854775807).", nil},
	{"pgfence_jobs", "gauge", "Unfinished jobs by queue and state (available, running). Only the queues with the most unfinished jobs are named; queue=\"" + OtherQueue + "\" sums up the rest.", []string{"queue", "state"}},
	{"pgfence_jobs_queues", "gauge", "Queues that have unfinished jobs (named ones and those summed up in queue=\"" + OtherQueue + "\").", nil},
	{"pgfence_jobs_claim_expired_seconds_max", "gauge", "Per queue, seconds since the oldest expired claim ran out (a stuck or dead worker); 0 if none.", []string{"queue"}},
	{"pgfence_jobs_expired_claims", "gauge", "Per queue, running jobs whose claim expired without completion (claimable again).", []string{"queue"}},
	{"pgfence_jobs_ready_age_seconds_max", "gauge", "Per queue, age in seconds of the oldest job that is ready to run but not claimed (queue latency).", []string{"queue"}},
	{"pgfence_jobs_dead_total", "counter", "Jobs that went dead (out of attempts or given up), all queues, since pgfence's schema was installed; deleting jobs does not lower it.", nil},
	{"pgfence_jobs_dead_by_queue_total", "counter", "Jobs that went dead, for the queues with the most of them (others have no series; see pgfence_jobs_dead_total).", []string{"queue"}},
	{"pgfence_exporter_collect_seconds", "gauge", "Time the collection served took (its database transaction).", nil},
	{"pgfence_exporter_collections_total", "counter", "Collections run since the exporter started; scrapes in between were served from the cache or shared a collection.", nil},
	{"pgfence_exporter_scrapes_rejected_total", "counter", "Scrapes answered 503 because too many waited for a collection, up to the collection served.", nil},
}

type descs struct {
	up, locks, expiredMax, heldSinceGrant, maxToken                  *prometheus.Desc
	jobs, queues, oldestClaim, expiredClaims, oldestReady            *prometheus.Desc
	deadTotal, deadByQueue, collectSeconds, collections, rejectedTot *prometheus.Desc
}

func newDescs() descs {
	desc := func(name string) *prometheus.Desc {
		for _, d := range Catalog {
			if d.Name == name {
				return prometheus.NewDesc(d.Name, d.Help, d.Labels, nil)
			}
		}
		panic("exporter: " + name + " is not in Catalog")
	}
	return descs{
		up:             desc("pgfence_up"),
		locks:          desc("pgfence_locks"),
		expiredMax:     desc("pgfence_lock_expired_seconds_max"),
		heldSinceGrant: desc("pgfence_lock_held_since_grant_seconds_max"),
		maxToken:       desc("pgfence_lock_token_max"),
		jobs:           desc("pgfence_jobs"),
		queues:         desc("pgfence_jobs_queues"),
		oldestClaim:    desc("pgfence_jobs_claim_expired_seconds_max"),
		expiredClaims:  desc("pgfence_jobs_expired_claims"),
		oldestReady:    desc("pgfence_jobs_ready_age_seconds_max"),
		deadTotal:      desc("pgfence_jobs_dead_total"),
		deadByQueue:    desc("pgfence_jobs_dead_by_queue_total"),
		collectSeconds: desc("pgfence_exporter_collect_seconds"),
		collections:    desc("pgfence_exporter_collections_total"),
		rejectedTot:    desc("pgfence_exporter_scrapes_rejected_total"),
	}
}

// queueRow is one queue label's numbers; rows whose labels clash once made
// valid UTF-8 are merged.
type queueRow struct {
	label                             string
	available, running, expired       float64
	readyAgeSeconds, claimExpiredSecs float64
}

func (e *Exporter) render(s *snapshot, collectErr error, took time.Duration, n int64) *result {
	d := e.descs
	var ms []prometheus.Metric
	gauge := func(desc *prometheus.Desc, v float64, labels ...string) {
		ms = append(ms, prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, v, labels...))
	}
	counter := func(desc *prometheus.Desc, v float64, labels ...string) {
		ms = append(ms, prometheus.MustNewConstMetric(desc, prometheus.CounterValue, v, labels...))
	}
	e.mu.Lock()
	rejected := e.rejected
	e.mu.Unlock()
	counter(d.collections, float64(n))
	counter(d.rejectedTot, float64(rejected))
	gauge(d.collectSeconds, took.Seconds())
	if collectErr != nil {
		gauge(d.up, 0)
	} else {
		gauge(d.up, 1)
		l := s.locks
		gauge(d.locks, float64(l.Held), "held")
		gauge(d.locks, float64(l.Expired), "expired")
		gauge(d.locks, float64(l.Free), "free")
		gauge(d.expiredMax, l.ExpiredSecondsMax)
		gauge(d.heldSinceGrant, l.HeldSecondsMax)
		gauge(d.maxToken, float64(l.TokenMax))
		if s.hasJobs {
			var nq int64
			var rows []*queueRow
			byLabel := map[string]*queueRow{}
			for _, q := range s.queues {
				nq += q.Queues
				label := labelValue(q.Label)
				r := byLabel[label]
				if r == nil {
					r = &queueRow{label: label}
					byLabel[label] = r
					rows = append(rows, r)
				}
				r.available += float64(q.Available)
				r.running += float64(q.Running)
				r.expired += float64(q.ExpiredClaims)
				r.readyAgeSeconds = max(r.readyAgeSeconds, q.ReadyAgeSeconds)
				r.claimExpiredSecs = max(r.claimExpiredSecs, q.ClaimExpiredSeconds)
			}
			gauge(d.queues, float64(nq))
			for _, r := range rows {
				gauge(d.jobs, r.available, r.label, "available")
				gauge(d.jobs, r.running, r.label, "running")
				gauge(d.expiredClaims, r.expired, r.label)
				gauge(d.oldestClaim, r.claimExpiredSecs, r.label)
				gauge(d.oldestReady, r.readyAgeSeconds, r.label)
			}
		}
		if s.hasDead {
			var total int64
			byLabel := map[string]int64{}
			var labels []string
			for _, r := range s.dead {
				total = r.Total
				label := labelValue(r.Queue)
				if _, ok := byLabel[label]; !ok {
					labels = append(labels, label)
				}
				byLabel[label] += r.Dead
			}
			counter(d.deadTotal, float64(total))
			for _, label := range labels {
				counter(d.deadByQueue, float64(byLabel[label]), label)
			}
		}
	}
	body, err := encode(ms)
	if err != nil {
		// Cannot happen with the label sets above; report it rather than
		// serve a partial page.
		e.log.Error("pgfence exporter: rendering failed", "err", err)
		body, _ = encode([]prometheus.Metric{prometheus.MustNewConstMetric(d.up, prometheus.GaugeValue, 0)})
		if collectErr == nil {
			collectErr = err
		}
	}
	res := &result{body: body, done: time.Now(), err: collectErr}
	var gz bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&gz, gzip.BestSpeed)
	if _, err := zw.Write(body); err == nil && zw.Close() == nil {
		res.gz = slices.Clip(gz.Bytes())
	}
	return res
}

// labelValue makes a queue name a valid label value (UTF-8). Queue names are
// text in a UTF-8 database, so this only matters for SQL_ASCII databases.
func labelValue(s string) string { return strings.ToValidUTF8(s, "\uFFFD") }

// constCollector hands fixed metrics to a registry, which checks them
// (consistent label names, no duplicate series) and sorts them.
type constCollector []prometheus.Metric

func (c constCollector) Describe(ch chan<- *prometheus.Desc) {
	seen := map[*prometheus.Desc]bool{}
	for _, m := range c {
		if d := m.Desc(); !seen[d] {
			seen[d] = true
			ch <- d
		}
	}
}

func (c constCollector) Collect(ch chan<- prometheus.Metric) {
	for _, m := range c {
		ch <- m
	}
}

func encode(ms []prometheus.Metric) ([]byte, error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(constCollector(ms)); err != nil {
		return nil, err
	}
	fams, err := reg.Gather()
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	for _, f := range fams {
		if _, err := expfmt.MetricFamilyToText(&buf, f); err != nil {
			return nil, err
		}
	}
	return slices.Clip(buf.Bytes()), nil
}
