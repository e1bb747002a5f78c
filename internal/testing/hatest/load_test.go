package hatest

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/hacluster"
	"github.com/pgfence/pgfence/internal/testing/history"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// haEnableSQL enables the HA epoch in a database (docs/ha.md prints it).
const haEnableSQL = "SELECT pgfence.ha_enable();"

//go:embed on_role_change.sh
var onRoleChangeScript string

const (
	churnKeys    = 3 // lock names the churn workers share
	churnWorkers = 6
	holders      = 2               // long-lived keep-alive leases
	leaseTTL     = 2 * time.Second // every lease's TTL
	claimTTL     = 3 * time.Second
	epochSize    = int64(1) << 32
	gateSQLState = "PFHA1"
	txQueue      = "ha-tx"  // the Worker's queue (effect in the completing transaction)
	rawQueue     = "ha-raw" // raw Claim + Complete
)

// grantRec is one grant a client was told it has.
type grantRec struct {
	Name       string
	Token      int64
	Client     string
	Sent, Ack  time.Time
	WritePort  int // server port of the fenced write right after it (churn), 0 if none
	WriteAcked time.Time
}

// writeRec is one acknowledged fenced write.
type writeRec struct {
	Name  string
	Token int64
	Port  int
	Ack   time.Time
}

// leaseEnd is a holder's lease whose Done fired.
type leaseEnd struct {
	Name  string
	Token int64
	At    time.Time
	Err   error
}

// completion is an acknowledged raw Complete.
type completion struct {
	JobID, Token int64
	Ack          time.Time
}

// recorder collects what clients were told.
type recorder struct {
	mu           sync.Mutex
	grants       []*grantRec
	churnWrites  []writeRec
	heldWrites   []writeRec
	ends         []leaseEnd
	completions  []completion
	violations   []string
	staleRefused int
	claimLost    int
	gateRefusals int
	errCounts    map[string]int
	current      map[string]*heldLease // holder name → live lease
}

// heldLease is a holder's current lease as the event checks see it.
type heldLease struct {
	lease   *pglock.Lease
	granted time.Time
	wrote   time.Time // last acknowledged write
}

func newRecorder() *recorder {
	return &recorder{errCounts: map[string]int{}, current: map[string]*heldLease{}}
}

func (r *recorder) violation(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.violations = append(r.violations, fmt.Sprintf(format, args...))
}

// err counts an error a client met (connection errors, refusals, ...).
func (r *recorder) err(op string, err error) {
	var pgErr *pgconn.PgError
	key := op + ": "
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == gateSQLState:
		key += "epoch gate (bump not run yet)"
	case errors.As(err, &pgErr):
		key += "SQLSTATE " + pgErr.Code
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		key += "timeout"
	case errors.Is(err, pgfence.ErrLocked):
		key += "locked"
	case errors.Is(err, pgfence.ErrStaleToken):
		key += "stale token"
	default:
		key += "connection or other"
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errCounts[key]++
	if errors.As(err, &pgErr) && pgErr.Code == gateSQLState {
		r.gateRefusals++
	}
}

// scenario is one database on the cluster with the whole load running on it.
type scenario struct {
	t     *testing.T
	c     *hacluster.Cluster
	db    string
	async bool // epoch gate, bump and guards installed
	pool  *pgxpool.Pool
	items *fencedwrite.Table // churn rows, strict (fence < token)
	held  *fencedwrite.Table // holders' rows, re-entrant (fence <= token)
	rec   *recorder
	hist  *history.Recorder // every lease and fenced-write operation, checked at the end
	// Raw jobs enqueued and not known completed: a claim cut by the event
	// may have taken any of them (history.Client.Claim).
	rawMu      sync.Mutex
	rawPending map[int64]bool

	ctx     context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	lockers []*pglock.Locker
	worker  *skiplocked.Worker
	workerC chan error
	stopped atomic.Bool
	events  []*event
}

var dbSeq atomic.Int64

// newScenario creates a database, migrates it, installs the tables (and in
// async mode the epoch gate and the guards) and starts the load.
func newScenario(t *testing.T, c *hacluster.Cluster, async bool) *scenario {
	t.Helper()
	ctx := context.Background()
	s := &scenario{t: t, c: c, db: fmt.Sprintf("hatest_%d", dbSeq.Add(1)), async: async, rec: newRecorder(), hist: history.New(),
		rawPending: map[int64]bool{}}
	sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	admin, err := pgx.Connect(sctx, c.DSN("postgres"))
	if err != nil {
		t.Fatalf("connect through the multi-host URL: %v", err)
	}
	_, err = admin.Exec(sctx, "CREATE DATABASE "+pgx.Identifier{s.db}.Sanitize())
	admin.Close(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A client on the multi-host URL tries the hosts in order and gives up
	// at the first one that answers "database does not exist" (SQLSTATE
	// 3D000, like libpq): until every replica has replayed CREATE DATABASE,
	// connections fail. Wait for all nodes.
	waitDatabaseEverywhere(t, sctx, c, s.db)
	cfg, err := pgxpool.ParseConfig(c.DSN(s.db))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 24
	s.pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.pool.Close)
	if err := migrations.UpPool(sctx, s.pool); err != nil {
		t.Fatalf("migrations through the multi-host URL: %v", err)
	}
	if _, err := s.pool.Exec(sctx, `
		CREATE TABLE ha_items (id text PRIMARY KEY, v bigint NOT NULL DEFAULT 0, fence bigint NOT NULL DEFAULT 0);
		CREATE TABLE ha_held (id text PRIMARY KEY, v bigint NOT NULL DEFAULT 0, fence bigint NOT NULL DEFAULT 0);
		CREATE TABLE ha_ledger (id bigserial PRIMARY KEY, name text NOT NULL, token bigint NOT NULL, port int NOT NULL,
		                        at timestamptz NOT NULL DEFAULT clock_timestamp());
		CREATE TABLE ha_effects (job_id bigint NOT NULL, token bigint NOT NULL);
		CREATE INDEX ON ha_effects (job_id);`); err != nil {
		t.Fatal(err)
	}
	for k := range churnKeys {
		if _, err := s.pool.Exec(sctx, "INSERT INTO ha_items (id) VALUES ($1)", churnName(k)); err != nil {
			t.Fatal(err)
		}
	}
	for h := range holders {
		if _, err := s.pool.Exec(sctx, "INSERT INTO ha_held (id) VALUES ($1)", holdName(h)); err != nil {
			t.Fatal(err)
		}
	}
	if async {
		if _, err := s.pool.Exec(sctx, haEnableSQL); err != nil {
			t.Fatalf("pgfence.ha_enable(): %v", err)
		}
		// The guards refuse any write whose token is below its lock's
		// latest: after a bump, every pre-promotion holder at once.
		if err := fencedwrite.Guard(sctx, s.pool, "ha_items", fencedwrite.GuardOptions{LockNameColumn: "id"}); err != nil {
			t.Fatal(err)
		}
		if err := fencedwrite.Guard(sctx, s.pool, "ha_held", fencedwrite.GuardOptions{LockNameColumn: "id", Mode: fencedwrite.Reentrant}); err != nil {
			t.Fatal(err)
		}
	}
	if s.items, err = fencedwrite.Prepare(sctx, s.pool, fencedwrite.Spec{Table: "ha_items", Key: []string{"id"}, Set: []string{"v"}}); err != nil {
		t.Fatal(err)
	}
	if s.held, err = fencedwrite.Prepare(sctx, s.pool, fencedwrite.Spec{Table: "ha_held", Key: []string{"id"}, Set: []string{"v"}, Mode: fencedwrite.Reentrant}); err != nil {
		t.Fatal(err)
	}
	s.start()
	t.Cleanup(s.halt)
	return s
}

// waitDatabaseEverywhere waits until every node lets clients connect to db.
func waitDatabaseEverywhere(t *testing.T, ctx context.Context, c *hacluster.Cluster, db string) {
	t.Helper()
	for _, n := range c.Nodes() {
		for {
			conn, err := pgx.Connect(ctx, c.NodeDSN(n.Name, db))
			if err == nil {
				conn.Close(context.Background())
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("database %s never appeared on %s: %v", db, n.Name, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

func churnName(k int) string { return fmt.Sprintf("churn:%d", k) }
func holdName(h int) string  { return fmt.Sprintf("hold:%d", h) }

func (s *scenario) newLocker(holder string) *pglock.Locker {
	l, err := pglock.New(s.pool, &pglock.Config{Holder: holder, KeepAlive: true})
	if err != nil {
		s.t.Fatal(err)
	}
	s.lockers = append(s.lockers, l)
	return l
}

// start runs the clients: churn workers, holders, a producer, raw claimers
// and a Worker.
func (s *scenario) start() {
	s.ctx, s.cancel = context.WithCancel(context.Background())
	for w := range churnWorkers {
		l := s.newLocker(fmt.Sprintf("churn-%d", w))
		s.wg.Add(1)
		go func() { defer s.wg.Done(); s.churn(w, l) }()
	}
	for h := range holders {
		l := s.newLocker(fmt.Sprintf("holder-%d", h))
		s.wg.Add(1)
		go func() { defer s.wg.Done(); s.holder(h, l) }()
	}
	s.wg.Add(1)
	go func() { defer s.wg.Done(); s.produce() }()
	for i := range 2 {
		s.wg.Add(1)
		go func() { defer s.wg.Done(); s.rawClaimer(i) }()
	}
	w, err := skiplocked.NewTxWorker(s.pool, txQueue, s.effect, &skiplocked.Config{
		Concurrency: 2, BatchSize: 2, ClaimTTL: claimTTL, PollInterval: 250 * time.Millisecond, ShutdownTimeout: 5 * time.Second,
	})
	if err != nil {
		s.t.Fatal(err)
	}
	s.worker = w
	s.workerC = make(chan error, 1)
	go func() { s.workerC <- w.Run(s.ctx) }()
}

// halt stops every client and waits for them (also on a failed test).
func (s *scenario) halt() {
	if s.stopped.Swap(true) {
		return
	}
	s.cancel()
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(90 * time.Second):
		s.t.Errorf("clients did not stop within 90 s")
	}
	select {
	case err := <-s.workerC:
		if err != nil {
			s.t.Errorf("Worker.Run: %v", err)
		}
	case <-time.After(60 * time.Second):
		s.t.Errorf("Worker.Run did not return within 60 s")
	}
	for _, l := range s.lockers {
		_ = l.Close()
	}
}

// backoff waits a little after an error (rate limiting, not a signal).
func (s *scenario) backoff() {
	select {
	case <-s.ctx.Done():
	case <-time.After(time.Duration(20+rand.IntN(40)) * time.Millisecond):
	}
}

// churn takes its lock again and again: grant, fenced write with a ledger
// row in the same transaction, release.
func (s *scenario) churn(w int, l *pglock.Locker) {
	name := churnName(w % churnKeys)
	client := fmt.Sprintf("churn-%d", w)
	hc := s.hist.NewClient()
	hc.KeepAlive = true
	for s.ctx.Err() == nil {
		sent := time.Now()
		actx, cancel := context.WithTimeout(s.ctx, 5*time.Second)
		lease, err := hc.Acquire(actx, l, name, leaseTTL, true)
		cancel()
		if err != nil {
			s.rec.err("acquire", err)
			s.backoff()
			continue
		}
		g := &grantRec{Name: name, Token: lease.Token(), Client: client, Sent: sent, Ack: time.Now()}
		s.rec.mu.Lock()
		s.rec.grants = append(s.rec.grants, g)
		s.rec.mu.Unlock()
		var port int
		err = hc.Fenced(name, lease.Token(), fencedwrite.Strict, "ha_items/"+name, strconv.FormatInt(lease.Token(), 10), func() error {
			var err error
			port, err = s.fencedWrite(name, lease.Token())
			return err
		})
		if err == nil {
			now := time.Now()
			s.rec.mu.Lock()
			g.WritePort, g.WriteAcked = port, now
			s.rec.churnWrites = append(s.rec.churnWrites, writeRec{Name: name, Token: lease.Token(), Port: port, Ack: now})
			s.rec.mu.Unlock()
		} else {
			s.rec.err("fenced write", err)
		}
		rctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		if err := hc.Release(rctx, lease); err != nil {
			s.rec.err("release", err)
		}
		cancel()
	}
}

// fencedWrite writes token to the churn row name (strict) and a ledger row
// in one transaction, and returns the port of the server that committed it.
func (s *scenario) fencedWrite(name string, token int64) (int, error) {
	ctx, cancel := context.WithTimeout(s.ctx, 5*time.Second)
	defer cancel()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := s.items.Update(ctx, tx, token, []any{name}, []any{token}); err != nil {
		return 0, err
	}
	var port int
	if err := tx.QueryRow(ctx, `INSERT INTO ha_ledger (name, token, port) VALUES ($1, $2, inet_server_port()) RETURNING port`,
		name, token).Scan(&port); err != nil {
		return 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, err
	}
	return port, nil
}

// holder keeps one lease with keep-alive and writes its row every 100 ms.
// When the lease ends (Done) it takes the lock again and, once the new
// grant has written, proves the ended grant is fenced: a write with its
// token must be refused.
func (s *scenario) holder(h int, l *pglock.Locker) {
	name := holdName(h)
	client := fmt.Sprintf("holder-%d", h)
	hc := s.hist.NewClient()
	hc.KeepAlive = true
	var ended int64 // token of the previous lease, to be proven fenced
	for s.ctx.Err() == nil {
		sent := time.Now()
		actx, cancel := context.WithTimeout(s.ctx, 30*time.Second)
		lease, err := hc.Acquire(actx, l, name, leaseTTL, true)
		cancel()
		if err != nil {
			s.rec.err("holder acquire", err)
			s.backoff()
			continue
		}
		now := time.Now()
		hl := &heldLease{lease: lease, granted: now}
		s.rec.mu.Lock()
		s.rec.grants = append(s.rec.grants, &grantRec{Name: name, Token: lease.Token(), Client: client, Sent: sent, Ack: now})
		s.rec.current[name] = hl
		s.rec.mu.Unlock()
		if ended != 0 && lease.Token() <= ended {
			s.rec.violation("%s: new grant %d is not above the ended grant %d", name, lease.Token(), ended)
		}
		tick := time.NewTicker(100 * time.Millisecond)
	hold:
		for {
			select {
			case <-s.ctx.Done():
				break hold
			case <-lease.Done():
				s.rec.mu.Lock()
				s.rec.ends = append(s.rec.ends, leaseEnd{Name: name, Token: lease.Token(), At: time.Now(), Err: lease.Err()})
				delete(s.rec.current, name)
				s.rec.mu.Unlock()
				ended = lease.Token()
				break hold
			case <-tick.C:
			}
			wctx, cancel := context.WithTimeout(lease.Context(), 3*time.Second)
			err := hc.Fenced(name, lease.Token(), fencedwrite.Reentrant, "ha_held/"+name, strconv.FormatInt(lease.Token(), 10), func() error {
				_, err := s.held.Update(wctx, s.pool, lease.Token(), []any{name}, []any{lease.Token()})
				return err
			})
			cancel()
			if err != nil {
				s.rec.err("holder write", err)
				continue
			}
			now := time.Now()
			s.rec.mu.Lock()
			s.rec.heldWrites = append(s.rec.heldWrites, writeRec{Name: name, Token: lease.Token(), Ack: now})
			hl.wrote = now
			s.rec.mu.Unlock()
			if ended != 0 {
				s.proveFenced(hc, s.held, name, ended, lease.Token())
				ended = 0
			}
		}
		tick.Stop()
		if s.ctx.Err() != nil {
			rctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			_ = hc.Release(rctx, lease)
			cancel()
			return
		}
	}
}

// proveFenced writes with a stale token after a newer one (newer) wrote
// the row: the write must be refused, whatever the connection error
// retries.
func (s *scenario) proveFenced(hc *history.Client, table *fencedwrite.Table, name string, stale, newer int64) {
	for attempt := 0; attempt < 50 && s.ctx.Err() == nil; attempt++ {
		ctx, cancel := context.WithTimeout(s.ctx, 5*time.Second)
		err := hc.Fenced(name, stale, fencedwrite.Reentrant, "ha_held/"+name, strconv.FormatInt(-stale, 10), func() error {
			_, err := table.Update(ctx, s.pool, stale, []any{name}, []any{-stale})
			return err
		})
		cancel()
		switch {
		case err == nil:
			s.rec.violation("%s: a write with the ended token %d was accepted after token %d wrote", name, stale, newer)
			return
		case errors.Is(err, pgfence.ErrStaleToken):
			s.rec.mu.Lock()
			s.rec.staleRefused++
			s.rec.mu.Unlock()
			return
		}
		s.rec.err("stale write", err)
		s.backoff()
	}
}

// produce enqueues jobs on both queues every 25 ms.
func (s *scenario) produce() {
	for s.ctx.Err() == nil {
		ps := make([]skiplocked.EnqueueParams, 0, 6)
		for i := range 6 {
			q := txQueue
			if i%2 == 1 {
				q = rawQueue
			}
			ps = append(ps, skiplocked.EnqueueParams{Queue: q, Payload: json.RawMessage(`{}`)})
		}
		ctx, cancel := context.WithTimeout(s.ctx, 5*time.Second)
		ids, err := skiplocked.Enqueue(ctx, s.pool, ps...)
		cancel()
		if err != nil {
			s.rec.err("enqueue", err)
		}
		s.rawMu.Lock()
		for i, id := range ids {
			if ps[i].Queue == rawQueue {
				s.rawPending[id] = true
			}
		}
		s.rawMu.Unlock()
		select {
		case <-s.ctx.Done():
		case <-time.After(25 * time.Millisecond):
		}
	}
}

// rawClaimer claims up to 4 raw jobs and completes each.
func (s *scenario) rawClaimer(i int) {
	holder := fmt.Sprintf("raw-%d", i)
	hc := s.hist.NewClient()
	for s.ctx.Err() == nil {
		ctx, cancel := context.WithTimeout(s.ctx, 5*time.Second)
		s.rawMu.Lock()
		known := make([]int64, 0, len(s.rawPending))
		for id := range s.rawPending {
			known = append(known, id)
		}
		s.rawMu.Unlock()
		jobs, err := hc.Claim(ctx, s.pool, skiplocked.ClaimParams{Queue: rawQueue, Holder: holder, Limit: 4, TTL: claimTTL}, known)
		cancel()
		if err != nil {
			s.rec.err("claim", err)
			s.backoff()
			continue
		}
		for _, j := range jobs {
			ctx, cancel := context.WithTimeout(s.ctx, 5*time.Second)
			err := hc.Complete(ctx, s.pool, j.Ref())
			cancel()
			switch {
			case err == nil:
				s.rawMu.Lock()
				delete(s.rawPending, j.ID)
				s.rawMu.Unlock()
				s.rec.mu.Lock()
				s.rec.completions = append(s.rec.completions, completion{JobID: j.Ref().JobID, Token: j.Ref().Token, Ack: time.Now()})
				s.rec.mu.Unlock()
			case errors.Is(err, pgfence.ErrLost):
				s.rec.mu.Lock()
				s.rec.claimLost++
				s.rec.mu.Unlock()
			default:
				s.rec.err("complete", err)
			}
		}
		if len(jobs) == 0 {
			s.backoff()
		}
	}
}

// effect is the Worker's handler: its effect row commits with the
// completion, so a job's effect exists exactly once.
func (s *scenario) effect(ctx context.Context, tx pgx.Tx, job skiplocked.Job) error {
	_, err := tx.Exec(ctx, "INSERT INTO ha_effects (job_id, token) VALUES ($1, $2)", job.Ref().JobID, job.Ref().Token)
	return err
}

// ---- events ----

// eventKind is a way the leader changes.
type eventKind string

const (
	kindSwitchover     eventKind = "switchover"
	kindPostmasterKill eventKind = "postmaster kill"
	kindNodeKill       eventKind = "node kill"
	kindPause          eventKind = "paused primary"
)

// event records one leader change and what the clients saw.
type event struct {
	Mode            hacluster.Mode
	Kind            eventKind
	From, To        string
	Start           time.Time
	NewLeader       time.Duration // until another node held the leader key (kill, pause)
	Unavailable     time.Duration // start → first grant whose write committed on the new leader
	Gap             time.Duration // longest stretch without an acknowledged grant around the event
	Healthy         time.Duration // start → leader + all replicas streaming again
	LeasesEnded     int           // holder leases whose Done fired
	LeasesSurvived  int           // holder leases renewed on the new primary
	GrantsLost      int           // async: acknowledged grants the new primary did not have
	WritesLost      int           // acknowledged churn writes missing on the new primary
	StaleRefused    int           // async: old tokens refused right after the bump
	GateRefused     int           // grants refused by the epoch gate during the event
	Bump            time.Duration // async: start → the new primary's epoch bump committed
	RestartsInPlace int           // postmaster kills Patroni answered by restarting the same node
	WorkerCompleted int64         // Worker completions during the event window
}

// runEvent changes the leader by kind, waits for the cluster and the
// clients to recover, and checks the new primary.
func (s *scenario) runEvent(kind eventKind) *event {
	t := s.t
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	h, err := s.c.WaitHealthy(ctx)
	if err != nil {
		t.Fatalf("before %s: %v%s", kind, err, s.c.Logs(30))
	}
	ev := &event{Mode: s.c.Mode(), Kind: kind, From: h.Leader}
	s.rec.mu.Lock()
	gateBefore := s.rec.gateRefusals
	s.rec.mu.Unlock()
	completedBefore := s.worker.Summary().Completed
	// Holders' leases that exist now: each must either end (Done) or be
	// renewed on the new primary under the same token.
	survivors := s.liveHolderLeases()

	ev.Start = time.Now()
	switch kind {
	case kindSwitchover:
		if _, ev.To, err = s.c.Switchover(ctx, ""); err != nil {
			t.Fatalf("switchover: %v%s", err, s.c.Logs(30))
		}
	case kindPostmasterKill:
		// With primary_start_timeout 0 Patroni fails over at once, but only
		// if it finds a candidate: when no replica's REST API answers it in
		// time (a loaded machine), it restarts PostgreSQL in place, on a new
		// timeline. That is correct, but not a failover: kill it again.
		for attempt := 1; ; attempt++ {
			if err := s.c.KillPostmaster(h.Leader); err != nil {
				t.Fatal(err)
			}
			h2, err := s.c.WaitHealthy(ctx)
			if err != nil {
				t.Fatalf("after %s: %v%s", kind, err, s.c.Logs(40))
			}
			if h2.Leader != h.Leader {
				break
			}
			if attempt == 5 {
				t.Fatalf("%s: Patroni restarted %s in place %d times instead of failing over%s", kind, h.Leader, attempt, s.c.Logs(40))
			}
			ev.RestartsInPlace++
			t.Logf("%s: Patroni restarted %s's PostgreSQL in place (no failover candidate answered in time); killing it again", kind, h.Leader)
			ev.Start = time.Now()
		}
	case kindNodeKill:
		if err := s.c.KillNode(h.Leader); err != nil {
			t.Fatal(err)
		}
		ev.To = s.waitNewLeader(ctx, h.Leader)
		ev.NewLeader = time.Since(ev.Start)
		if err := s.c.StartNode(h.Leader); err != nil {
			t.Fatal(err)
		}
	case kindPause:
		if err := s.c.Pause(h.Leader); err != nil {
			t.Fatal(err)
		}
		ev.To = s.waitNewLeader(ctx, h.Leader)
		ev.NewLeader = time.Since(ev.Start)
		if err := s.c.Resume(h.Leader); err != nil {
			t.Fatal(err)
		}
	}
	h2, err := s.c.WaitHealthy(ctx)
	if err != nil {
		t.Fatalf("after %s: %v%s", kind, err, s.c.Logs(40))
	}
	ev.Healthy = time.Since(ev.Start)
	if ev.To != "" && ev.To != h2.Leader {
		// The leader changed once more before the cluster was healthy (a
		// Patroni loop that missed its ttl on a loaded machine). The checks
		// below hold whoever leads; note it.
		t.Logf("%s: %s took over from %s, but %s leads now", kind, ev.To, h.Leader, h2.Leader)
	}
	ev.To = h2.Leader
	newPort := s.c.Node(h2.Leader).Port

	// The clients recover: a grant whose write committed on the new leader,
	// Worker completions, raw completions and holder writes after the event.
	var first *grantRec
	deadline := time.Now().Add(2 * time.Minute)
	for {
		first = s.firstGrantOn(newPort, ev.Start)
		ok := first != nil && s.worker.Summary().Completed > completedBefore &&
			s.completedSince(ev.Start) && s.holdersWroteSince(ev.Start)
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: clients did not recover within 2 minutes of the new leader being healthy: grant on the new leader %v, "+
				"Worker completions %d → %d, raw completion %v, holders wrote %v; errors %v",
				kind, first != nil, completedBefore, s.worker.Summary().Completed, s.completedSince(ev.Start), s.holdersWroteSince(ev.Start), s.errSummary())
		}
		time.Sleep(50 * time.Millisecond)
	}
	ev.Unavailable = first.Ack.Sub(ev.Start)
	ev.Gap = s.longestGap(ev.Start.Add(-time.Second), first.Ack)
	ev.WorkerCompleted = s.worker.Summary().Completed - completedBefore

	s.checkSurvivors(ev, survivors)
	s.checkFenceBelowToken(ctx, kind.String())
	if s.async {
		s.checkBump(ctx, ev, h2.Timeline)
	}
	s.rec.mu.Lock()
	ev.GateRefused = s.rec.gateRefusals - gateBefore
	s.rec.mu.Unlock()
	s.events = append(s.events, ev)
	asyncPart := ""
	if ev.RestartsInPlace > 0 {
		asyncPart = fmt.Sprintf("; Patroni first restarted the killed primary in place %d times", ev.RestartsInPlace)
	}
	if s.async {
		asyncPart += fmt.Sprintf("; async: bump committed after %v, acknowledged grants lost %d, old tokens refused %d, gate refusals %d",
			ev.Bump.Round(time.Millisecond), ev.GrantsLost, ev.StaleRefused, ev.GateRefused)
	}
	t.Logf("%-15s %-11s %s→%s: new leader key after %v, first grant on the new primary after %v (longest grant gap %v), healthy after %v; "+
		"holder leases ended %d, survived %d; Worker completed %d meanwhile%s",
		kind, ev.Mode, ev.From, ev.To, ev.NewLeader.Round(time.Millisecond), ev.Unavailable.Round(time.Millisecond), ev.Gap.Round(time.Millisecond),
		ev.Healthy.Round(time.Millisecond), ev.LeasesEnded, ev.LeasesSurvived, ev.WorkerCompleted, asyncPart)
	return ev
}

func (k eventKind) String() string { return string(k) }

// waitNewLeader waits until a node other than old holds the leader key.
func (s *scenario) waitNewLeader(ctx context.Context, old string) string {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		l, err := s.c.Leader(ctx)
		if err == nil && l != "" && l != old {
			return l
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("no new leader 2 minutes after %s was taken down (last: %q, %v)%s", old, l, err, s.c.Logs(30))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (s *scenario) liveHolderLeases() map[string]*pglock.Lease {
	s.rec.mu.Lock()
	defer s.rec.mu.Unlock()
	m := map[string]*pglock.Lease{}
	for name, hl := range s.rec.current {
		m[name] = hl.lease
	}
	return m
}

// firstGrantOn returns the first churn grant sent after since whose fenced
// write committed on the server listening on port.
func (s *scenario) firstGrantOn(port int, since time.Time) *grantRec {
	s.rec.mu.Lock()
	defer s.rec.mu.Unlock()
	var first *grantRec
	for _, g := range s.rec.grants {
		if g.WritePort == port && g.Sent.After(since) && (first == nil || g.Ack.Before(first.Ack)) {
			first = g
		}
	}
	return first
}

func (s *scenario) completedSince(t time.Time) bool {
	s.rec.mu.Lock()
	defer s.rec.mu.Unlock()
	for i := len(s.rec.completions) - 1; i >= 0; i-- {
		if s.rec.completions[i].Ack.After(t) {
			return true
		}
	}
	return false
}

func (s *scenario) holdersWroteSince(t time.Time) bool {
	s.rec.mu.Lock()
	defer s.rec.mu.Unlock()
	for h := range holders {
		hl := s.rec.current[holdName(h)]
		if hl == nil || !hl.wrote.After(t) {
			return false
		}
	}
	return true
}

// longestGap is the longest time between acknowledged grants in [from, to].
func (s *scenario) longestGap(from, to time.Time) time.Duration {
	s.rec.mu.Lock()
	var acks []time.Time
	for _, g := range s.rec.grants {
		if !g.Ack.Before(from) && !g.Ack.After(to) {
			acks = append(acks, g.Ack)
		}
	}
	s.rec.mu.Unlock()
	acks = append(acks, from, to)
	sort.Slice(acks, func(i, j int) bool { return acks[i].Before(acks[j]) })
	var gap time.Duration
	for i := 1; i < len(acks); i++ {
		gap = max(gap, acks[i].Sub(acks[i-1]))
	}
	return gap
}

// checkSurvivors: a holder's lease from before the event either ended
// (Done fired, then the holder took the lock again under a larger token)
// or is still held, which is only right if the new primary has the lease's
// very row: same holder, same token, held.
func (s *scenario) checkSurvivors(ev *event, before map[string]*pglock.Lease) {
	for name, lease := range before {
		select {
		case <-lease.Done():
			ev.LeasesEnded++
			continue
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		info, err := pglock.Inspect(ctx, s.pool, name)
		cancel()
		if err != nil {
			s.t.Errorf("%s: inspect %s: %v", ev.Kind, name, err)
			continue
		}
		select {
		case <-lease.Done():
			ev.LeasesEnded++
			continue
		default:
		}
		if info.Token == lease.Token() && info.Holder == lease.Holder() && info.Held {
			ev.LeasesSurvived++
			continue
		}
		// The row moved on (async: the bump raised the token): the
		// lease's next renewal is refused, so Done must fire within its TTL.
		select {
		case <-lease.Done():
			ev.LeasesEnded++
		case <-time.After(leaseTTL + 10*time.Second):
			s.rec.violation("%s: %s lease token %d still live locally %v after the new primary showed token %d holder %q held %v",
				ev.Kind, name, lease.Token(), leaseTTL+10*time.Second, info.Token, info.Holder, info.Held)
		}
	}
}

// checkFenceBelowToken: on the current primary every fenced row's fence is
// ≤ its lock's token, so the next grant fences out every write there.
func (s *scenario) checkFenceBelowToken(ctx context.Context, when string) {
	rows, err := s.pool.Query(ctx, `
		SELECT i.id, i.fence, COALESCE(l.token, 0) FROM (SELECT id, fence FROM ha_items UNION ALL SELECT id, fence FROM ha_held) i
		LEFT JOIN pgfence.locks l ON l.name = i.id`)
	if err != nil {
		s.t.Errorf("%s: fence check: %v", when, err)
		return
	}
	type row struct {
		ID           string
		Fence, Token int64
	}
	rs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		s.t.Errorf("%s: fence check: %v", when, err)
		return
	}
	if len(rs) != churnKeys+holders {
		s.t.Errorf("%s: %d fenced rows, want %d", when, len(rs), churnKeys+holders)
	}
	for _, r := range rs {
		if r.Fence > r.Token {
			s.rec.violation("%s: row %s has fence %d above its lock's token %d on the new primary", when, r.ID, r.Fence, r.Token)
		}
	}
}

// checkBump (async): the new primary's bump ran (once for this timeline),
// counts the acknowledged grants it did not have, and proves that the
// highest token acknowledged before the bump is refused on every row.
func (s *scenario) checkBump(ctx context.Context, ev *event, timeline int) {
	var tl, bumps int
	var bumpedAt time.Time
	if err := s.pool.QueryRow(ctx, "SELECT timeline, bumps, bumped_at FROM pgfence.ha_epoch").Scan(&tl, &bumps, &bumpedAt); err != nil {
		s.t.Errorf("%s: read epoch: %v", ev.Kind, err)
		return
	}
	if tl != timeline {
		s.rec.violation("%s: epoch is for timeline %d, the new primary is on timeline %d", ev.Kind, tl, timeline)
	}
	ev.Bump = bumpedAt.Sub(ev.Start)
	before := map[string]int64{}
	rows, err := s.pool.Query(ctx, "SELECT name, token_before FROM pgfence.ha_bumps WHERE timeline = $1", timeline)
	if err != nil {
		s.t.Errorf("%s: read bumps: %v", ev.Kind, err)
		return
	}
	var name string
	var tok int64
	if _, err := pgx.ForEachRow(rows, []any{&name, &tok}, func() error { before[name] = tok; return nil }); err != nil {
		s.t.Errorf("%s: read bumps: %v", ev.Kind, err)
		return
	}
	if len(before) == 0 {
		s.rec.violation("%s: no bump recorded for timeline %d", ev.Kind, timeline)
		return
	}
	epoch := int64(bumps) * epochSize
	// Acknowledged grants of the previous epoch the new primary never saw,
	// and the highest acknowledged token of each lock before the bump.
	maxOld := map[string]int64{}
	s.rec.mu.Lock()
	for _, g := range s.rec.grants {
		if g.Token >= epoch || g.Token < epoch-epochSize {
			continue
		}
		maxOld[g.Name] = max(maxOld[g.Name], g.Token)
		if g.Token > before[g.Name] {
			ev.GrantsLost++
		}
	}
	s.rec.mu.Unlock()
	for name, tok := range maxOld {
		table := s.items
		if strings.HasPrefix(name, "hold:") {
			table = s.held
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := table.Update(wctx, s.pool, tok, []any{name}, []any{-tok})
		cancel()
		switch {
		case err == nil:
			s.rec.violation("%s: after the bump, a write with %s's last pre-bump token %d was accepted", ev.Kind, name, tok)
		case errors.Is(err, pgfence.ErrStaleToken):
			ev.StaleRefused++
		default:
			s.t.Errorf("%s: stale write probe on %s: %v", ev.Kind, name, err)
		}
	}
}

func (s *scenario) errSummary() string {
	s.rec.mu.Lock()
	defer s.rec.mu.Unlock()
	keys := make([]string, 0, len(s.rec.errCounts))
	for k := range s.rec.errCounts {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s ×%d; ", k, s.rec.errCounts[k])
	}
	return b.String()
}
