// Package exporter reports pgfence's database-side state as Prometheus metrics:
// what the lock table and the job queue look like, read with the database's
// clock. It is served by `pgfence exporter`.
//
// A scrape costs the database a bounded amount, whoever chooses the queue
// names and however many finished jobs are kept:
//
//   - Concurrent scrapes share one collection (one read-only transaction of
//     four queries); at most [Options.MaxWaiting] scrapes wait for it, later
//     ones get 503 at once.
//   - A collection's result serves every scrape for [Options.CacheTTL]
//     (default 5s), failures included, so a down database is not hammered.
//   - A collection has a deadline ([Options.Timeout]), also set as the
//     transaction's statement_timeout and lock_timeout.
//   - Jobs are counted from the partial indexes on unfinished states
//     (available, running): the backlog is read, never the finished history.
//     Dead jobs come from a counter table kept by a trigger
//     (pgfence.job_dead_counts), a counter that deleting old jobs does not
//     lower; completed jobs are not counted (completion rates are the
//     workers' pgfence_rows_completed_total).
//   - Per-queue series are limited to the [Options.TopQueues] queues with the
//     most unfinished jobs, plus one series labelled [OtherQueue] that sums up
//     the rest; dead counters per queue to the TopQueues queues with the most
//     dead jobs, plus a total over all queues.
//
// The response is rendered once per collection and the same bytes (gzipped
// when the client accepts it) go to every scrape it serves.
package exporter

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/common/expfmt"

	"github.com/pgfence/pgfence/internal/dbsqlc"
)

// Defaults and limits of [Options].
const (
	// DefaultTimeout bounds one collection: its queries, and the wait for a
	// connection.
	DefaultTimeout = 5 * time.Second
	// DefaultCacheTTL is how long one collection serves scrapes.
	DefaultCacheTTL = 5 * time.Second
	// DefaultTopQueues is the number of queues reported by name.
	DefaultTopQueues = 50
	// DefaultMaxWaiting is the number of scrapes that may wait for a
	// collection at once.
	DefaultMaxWaiting = 64

	// MaxTimeout, MaxCacheTTL, MaxTopQueues and MaxWaitingLimit are the
	// largest values [New] accepts.
	MaxTimeout      = 10 * time.Minute
	MaxCacheTTL     = time.Hour
	MaxTopQueues    = 10000
	MaxWaitingLimit = 10000
)

// OtherQueue is the queue label of the series that sum up every queue outside
// the top [Options.TopQueues]. A queue that is really named so is counted in
// it. Queue names can be any string, so no label value is safe from a clash;
// this one is at least unlikely to be chosen for a real queue.
const OtherQueue = "__other__"

// ErrBusy is returned (and served as 503 Service Unavailable) when
// [Options.MaxWaiting] scrapes already wait for a collection.
var ErrBusy = errors.New("exporter: too many scrapes waiting for the current collection")

// Options configure an [Exporter]. Zero fields take the defaults above.
type Options struct {
	// Timeout bounds one collection (DefaultTimeout if 0). It is the
	// context deadline of the queries and the transaction's
	// statement_timeout and lock_timeout.
	Timeout time.Duration
	// CacheTTL is how long a collection's result, success or failure,
	// serves later scrapes (DefaultCacheTTL if 0). A negative value turns
	// the cache off: every scrape that finds no collection running starts
	// one, and scrapes that overlap still share it.
	CacheTTL time.Duration
	// TopQueues is the number of queues reported by name
	// (DefaultTopQueues if 0, at most MaxTopQueues).
	TopQueues int
	// MaxWaiting is the number of scrapes that may wait for a running
	// collection (DefaultMaxWaiting if 0); more get ErrBusy, served as 503.
	// Scrapes served from the cache never wait.
	MaxWaiting int
	// Logger receives collection errors (one line per failed collection).
	// Nil discards them.
	Logger *slog.Logger
}

// Exporter serves pgfence's metrics over HTTP ([Exporter.ServeHTTP]).
// Create it with [New] and stop it with [Exporter.Close].
type Exporter struct {
	pool *pgxpool.Pool
	opts Options
	log  *slog.Logger
	q    *dbsqlc.Queries

	ctx    context.Context // parent of every collection, canceled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu          sync.Mutex
	cur         *result // latest finished collection
	flight      *flight // collection running, nil if none
	waiting     int     // scrapes waiting for flight
	collections int64   // collections started
	rejected    int64   // scrapes answered ErrBusy
	closed      bool

	descs descs
}

// result is one rendered collection.
type result struct {
	body []byte    // text exposition format
	gz   []byte    // body gzipped, nil if compression failed
	done time.Time // when the collection ended (monotonic)
	err  error     // collection error, if any (body then says pgfence_up 0)
}

type flight struct {
	done chan struct{}
	res  *result
}

// New returns an exporter over pool. It checks opts and fills in defaults; it
// does not touch the database.
func New(pool *pgxpool.Pool, opts Options) (*Exporter, error) {
	if pool == nil {
		return nil, errors.New("exporter: nil pool")
	}
	switch {
	case opts.Timeout < 0 || opts.Timeout > MaxTimeout:
		return nil, fmt.Errorf("exporter: timeout %v out of range (0, %v]", opts.Timeout, MaxTimeout)
	case opts.CacheTTL > MaxCacheTTL:
		return nil, fmt.Errorf("exporter: cache TTL %v above %v", opts.CacheTTL, MaxCacheTTL)
	case opts.TopQueues < 0 || opts.TopQueues > MaxTopQueues:
		return nil, fmt.Errorf("exporter: top queues %d out of range [1, %d]", opts.TopQueues, MaxTopQueues)
	case opts.MaxWaiting < 0 || opts.MaxWaiting > MaxWaitingLimit:
		return nil, fmt.Errorf("exporter: max waiting %d out of range [1, %d]", opts.MaxWaiting, MaxWaitingLimit)
	}
	if opts.Timeout == 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.CacheTTL == 0 {
		opts.CacheTTL = DefaultCacheTTL
	}
	if opts.TopQueues == 0 {
		opts.TopQueues = DefaultTopQueues
	}
	if opts.MaxWaiting == 0 {
		opts.MaxWaiting = DefaultMaxWaiting
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Exporter{
		pool:   pool,
		opts:   opts,
		log:    log,
		q:      dbsqlc.New(),
		ctx:    ctx,
		cancel: cancel,
		descs:  newDescs(),
	}, nil
}

// Options returns the options in force, defaults filled in.
func (e *Exporter) Options() Options { return e.opts }

// Close cancels a running collection and waits for it to end. Scrapes after
// Close get 503.
func (e *Exporter) Close() {
	e.mu.Lock()
	e.closed = true
	e.mu.Unlock()
	e.cancel()
	e.wg.Wait()
}

// Stats are counters of an [Exporter] since [New].
type Stats struct {
	Collections int64 // collections started (each is one database transaction)
	Rejected    int64 // scrapes answered 503 because MaxWaiting scrapes waited
	Waiting     int   // scrapes waiting for the running collection now
}

// Stats returns the exporter's counters.
func (e *Exporter) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return Stats{Collections: e.collections, Rejected: e.rejected, Waiting: e.waiting}
}

// ServeHTTP answers GET and HEAD with the metrics in the Prometheus text
// format: from the cache, from the running collection, or from a new one.
// It answers 503 when MaxWaiting scrapes already wait.
func (e *Exporter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	res, err := e.result(r.Context())
	if err != nil {
		if errors.Is(err, ErrBusy) {
			w.Header().Set("Retry-After", "1")
		}
		// When the client has gone, nobody reads this.
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	body := res.body
	h := w.Header()
	h.Set("Content-Type", string(expfmt.FmtText))
	h.Set("Vary", "Accept-Encoding")
	if res.gz != nil && acceptsGzip(r) {
		h.Set("Content-Encoding", "gzip")
		body = res.gz
	}
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if r.Method == http.MethodHead {
		return
	}
	_, _ = w.Write(body)
}

func acceptsGzip(r *http.Request) bool {
	for _, v := range r.Header.Values("Accept-Encoding") {
		for part := range strings.SplitSeq(v, ",") {
			name, params, _ := strings.Cut(part, ";")
			if !strings.EqualFold(strings.TrimSpace(name), "gzip") {
				continue
			}
			q := 1.0
			for p := range strings.SplitSeq(params, ";") {
				if k, v, ok := strings.Cut(strings.TrimSpace(p), "="); ok && strings.EqualFold(strings.TrimSpace(k), "q") {
					if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
						q = f
					}
				}
			}
			return q > 0
		}
	}
	return false
}

// result returns the cached result if it is younger than CacheTTL, else the
// result of the running collection or of a new one. It returns ErrBusy when
// MaxWaiting callers already wait, and ctx's error if ctx ends first (the
// collection goes on for the others).
func (e *Exporter) result(ctx context.Context) (*result, error) {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil, errors.New("exporter: closed")
	}
	if r := e.cur; r != nil && e.opts.CacheTTL > 0 && time.Since(r.done) < e.opts.CacheTTL {
		e.mu.Unlock()
		return r, nil
	}
	if e.waiting >= e.opts.MaxWaiting {
		e.rejected++
		e.mu.Unlock()
		return nil, ErrBusy
	}
	f := e.flight
	if f == nil {
		f = &flight{done: make(chan struct{})}
		e.flight = f
		e.collections++
		n := e.collections
		e.wg.Add(1)
		go e.run(f, n)
	}
	e.waiting++
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		e.waiting--
		e.mu.Unlock()
	}()
	select {
	case <-f.done:
		return f.res, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// run is one collection. Its context is the exporter's, not a scrape's: a
// scrape that gives up does not cancel it for the others.
func (e *Exporter) run(f *flight, n int64) {
	defer e.wg.Done()
	start := time.Now()
	ctx, cancel := context.WithTimeout(e.ctx, e.opts.Timeout)
	snap, err := e.collect(ctx)
	cancel()
	took := time.Since(start)
	if err != nil {
		e.log.Error("pgfence exporter: collection failed", "err", err, "seconds", took.Seconds())
	}
	res := e.render(snap, err, took, n)
	e.mu.Lock()
	e.cur = res
	e.flight = nil
	e.mu.Unlock()
	f.res = res
	close(f.done)
}
