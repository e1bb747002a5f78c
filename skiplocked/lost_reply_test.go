package skiplocked_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// outcomeFaults breaks the connections of a Worker's pool (see faultPool).
// The first statement whose SQL contains target is cut once, in one of two
// ways: after the server committed it, its reply swallowed and afterCommit
// run before the client sees the connection fail (a reply lost in flight),
// or, with blackhole, never sent at all though the client believes it sent
// (a statement lost in flight), until the test closes cutNow. With
// noRenew, every renewal (pgfence.job_renew) fails on its connection.
type outcomeFaults struct {
	target      []byte
	blackhole   bool
	afterCommit func()
	cutNow      chan struct{}
	noRenew     bool

	sent     chan struct{} // closed when the target statement was sent (or swallowed)
	cut      chan struct{} // closed when its connection was cut
	replyErr atomic.Bool   // the swallowed reply held an ErrorResponse: it did not commit
	once     sync.Once
}

func newOutcomeFaults(target string) *outcomeFaults {
	return &outcomeFaults{target: []byte(target), cutNow: make(chan struct{}), sent: make(chan struct{}), cut: make(chan struct{})}
}

const (
	connPass       int32 = iota
	connSwallowing       // the target was sent: swallow its reply up to ReadyForQuery, then cut
	connBlackholed       // the target was dropped: cut when cutNow is closed
	connCut
)

// faultConn is one connection of a faultPool.
type faultConn struct {
	net.Conn
	f       *outcomeFaults
	state   atomic.Int32
	pending bool // the target's SQL was written here: its next Execute is the target's
	closed  chan struct{}
	close   sync.Once

	mu     sync.Mutex
	readDL time.Time
	dlSet  chan struct{} // poked when the read deadline changes
}

// frontendHasExecute reports whether p, a run of frontend messages, holds
// an Execute ('E'): the write that runs a statement (its Parse may have
// gone in an earlier write, when pgx prepared it).
func frontendHasExecute(p []byte) bool {
	for len(p) >= 5 {
		n := int(binary.BigEndian.Uint32(p[1:5]))
		if n < 4 || len(p) < 1+n {
			return false
		}
		if p[0] == 'E' {
			return true
		}
		p = p[1+n:]
	}
	return false
}

func (c *faultConn) Write(p []byte) (int, error) {
	f := c.f
	if f.noRenew && bytes.Contains(p, []byte("pgfence.job_renew(")) {
		c.Close()
		return 0, net.ErrClosed
	}
	if bytes.Contains(p, f.target) {
		c.pending = true
	}
	if c.pending && frontendHasExecute(p) {
		c.pending = false
		first := false
		f.once.Do(func() { first = true })
		if first {
			if f.blackhole {
				c.state.Store(connBlackholed)
				close(f.sent)
				return len(p), nil
			}
			c.state.Store(connSwallowing) // before the write: its reply may be read at once
			n, err := c.Conn.Write(p)
			close(f.sent)
			return n, err
		}
	}
	return c.Conn.Write(p)
}

func (c *faultConn) Read(p []byte) (int, error) {
	if faulted, err := c.fault(nil); faulted {
		return 0, err
	}
	n, err := c.Conn.Read(p)
	// A read under way when the target was written (pgconn reads in the
	// background during slow writes) brings the target's reply: nothing
	// else is outstanding on the connection then.
	if faulted, err := c.fault(p[:n]); faulted {
		return 0, err
	}
	return n, err
}

// fault does what the connection's state says to a read, with got the bytes
// just read (not yet seen by the client): faulted is false when the read
// goes through.
func (c *faultConn) fault(got []byte) (faulted bool, err error) {
	switch c.state.Load() {
	case connSwallowing:
		if c.swallow(got) {
			c.f.afterCommit()
		}
		return true, c.cutConn()
	case connBlackholed:
		if err := c.hole(); err != nil {
			return true, err
		}
		return true, c.cutConn()
	case connCut:
		return true, net.ErrClosed
	}
	return false, nil
}

// swallow reads the target's reply up to its ReadyForQuery, sent once the
// statement's implicit transaction committed (or rolled back: an
// ErrorResponse before it sets replyErr). It reports whether it got there.
func (c *faultConn) swallow(buf []byte) bool {
	buf = append([]byte(nil), buf...)
	tmp := make([]byte, 4096)
	for {
		for len(buf) >= 5 {
			n := int(binary.BigEndian.Uint32(buf[1:5]))
			if len(buf) < 1+n {
				break
			}
			switch buf[0] {
			case 'E':
				c.f.replyErr.Store(true)
			case 'Z':
				return true
			}
			buf = buf[1+n:]
		}
		n, err := c.Conn.Read(tmp)
		buf = append(buf, tmp[:n]...)
		if err != nil {
			c.f.replyErr.Store(true)
			return false
		}
	}
}

// hole waits for the test to cut the connection of a dropped statement. It
// honours the read deadline (pgx's way to end a read when its context ends)
// and the connection's Close.
func (c *faultConn) hole() error {
	for {
		c.mu.Lock()
		dl := c.readDL
		c.mu.Unlock()
		var expired <-chan time.Time
		var timer *time.Timer
		if !dl.IsZero() {
			timer = time.NewTimer(time.Until(dl))
			expired = timer.C
		}
		var err error
		select {
		case <-c.f.cutNow:
		case <-c.closed:
			err = net.ErrClosed
		case <-expired:
			err = os.ErrDeadlineExceeded
		case <-c.dlSet:
			err = errDeadlineMoved
		}
		if timer != nil {
			timer.Stop()
		}
		if err != errDeadlineMoved {
			return err
		}
	}
}

var errDeadlineMoved = errors.New("the read deadline moved")

func (c *faultConn) cutConn() error {
	c.state.Store(connCut)
	c.Close()
	close(c.f.cut)
	return io.ErrUnexpectedEOF
}

func (c *faultConn) Close() error {
	c.close.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

func (c *faultConn) SetDeadline(t time.Time) error {
	c.setReadDL(t)
	return c.Conn.SetDeadline(t)
}

func (c *faultConn) SetReadDeadline(t time.Time) error {
	c.setReadDL(t)
	return c.Conn.SetReadDeadline(t)
}

func (c *faultConn) setReadDL(t time.Time) {
	c.mu.Lock()
	c.readDL = t
	c.mu.Unlock()
	select {
	case c.dlSet <- struct{}{}:
	default:
	}
}

// faultPool is a pool of 4 connections on dsn whose connections f breaks.
// Four connections: the Worker then has one claimer and one outcome writer.
// Plain TCP, so that the messages can be read (the test servers run without
// TLS).
func faultPool(t *testing.T, dsn string, f *outcomeFaults) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.TLSConfig = nil
	cfg.ConnConfig.Fallbacks = nil
	var d net.Dialer
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &faultConn{Conn: conn, f: f, closed: make(chan struct{}), dlSet: make(chan struct{}, 1)}, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// roundTrip measures the slowest of a few round trips to the database.
func roundTrip(t *testing.T, ctx context.Context, pool *pgxpool.Pool) time.Duration {
	t.Helper()
	var worst time.Duration
	for range 5 {
		start := time.Now()
		if _, err := pool.Exec(ctx, "SELECT 1"); err != nil {
			t.Fatal(err)
		}
		worst = max(worst, time.Since(start))
	}
	return worst
}

// lostReplyCase is one outcome the Worker writes: how its handler ends the
// attempt, the statement that writes it, and the Summary count it lands in.
type lostReplyCase struct {
	name   string
	target string
	// handler returns the attempt's result once proceed is closed; at
	// shutdown (release) it waits for its context instead.
	result   func(ctx context.Context) error
	shutdown bool // the outcome is the release of a handler cancelled at shutdown
	count    func(skiplocked.Summary) int64
}

func lostReplyCases() []lostReplyCase {
	return []lostReplyCase{
		{name: "release", target: "pgfence.job_release(", shutdown: true,
			result: func(ctx context.Context) error { <-ctx.Done(); return context.Cause(ctx) },
			count:  func(s skiplocked.Summary) int64 { return s.Released }},
		{name: "fail", target: "pgfence.job_fail(",
			result: func(context.Context) error { return errors.New("attempt failed") },
			count:  func(s skiplocked.Summary) int64 { return s.Failed }},
		{name: "fail-dead", target: "pgfence.job_fail(",
			result: func(context.Context) error { return skiplocked.Permanent(errors.New("attempt failed for good")) },
			count:  func(s skiplocked.Summary) int64 { return s.Dead }},
		{name: "complete", target: "pgfence.job_complete(",
			result: func(context.Context) error { return nil },
			count:  func(s skiplocked.Summary) int64 { return s.Completed }},
	}
}

// outcomeRun is a Worker on a faultPool with one job, its handler started.
type outcomeRun struct {
	w       *skiplocked.Worker
	job     skiplocked.Job // as the handler got it
	started time.Time      // when the handler started
	proceed chan struct{}  // closed to let the handler return
	stop    func() error
	lost    chan *pgfence.Error // OnClaimLost's calls
}

func startOutcomeRun(t *testing.T, ctx context.Context, pool *pgxpool.Pool, queue string, c lostReplyCase, ttl time.Duration) *outcomeRun {
	t.Helper()
	started := make(chan skiplocked.Job, 1)
	r := &outcomeRun{proceed: make(chan struct{}), lost: make(chan *pgfence.Error, 4)}
	r.w = newWorker(t, pool, queue, func(jctx context.Context, j skiplocked.Job) error {
		started <- j
		if c.shutdown {
			return c.result(jctx)
		}
		<-r.proceed
		return c.result(jctx)
	}, &skiplocked.Config{
		// BatchSize 2 with one job: the first claim is not followed by
		// another at once, and the next poll is a minute away. Only the
		// test claims the job again.
		Concurrency: 1, BatchSize: 2, PollOnly: true, PollInterval: time.Minute,
		ClaimTTL: ttl, ShutdownTimeout: 10 * time.Millisecond,
		Backoff:     func(int) time.Duration { return 0 }, // a failed job is claimable again at once
		OnClaimLost: func(_ context.Context, _ skiplocked.Job, err *pgfence.Error) { r.lost <- err },
	})
	r.stop = runWorker(t, r.w)
	select {
	case r.job = <-started:
		r.started = time.Now()
	case <-ctx.Done():
		t.Fatal("the handler never started")
	}
	return r
}

// finish makes the handler return (or the worker shut down, for a
// release), so that the outcome is written.
func (r *outcomeRun) finish(c lostReplyCase, stopped chan<- error) {
	if c.shutdown {
		go func() { stopped <- r.stop() }()
		return
	}
	close(r.proceed)
}

// claimAgain claims the job of queue for another worker and returns its new
// token, or 0 when it was not claimable.
func claimAgain(t *testing.T, ctx context.Context, admin *pgxpool.Pool, queue string, id int64) int64 {
	t.Helper()
	js, err := skiplocked.Claim(ctx, admin, skiplocked.ClaimParams{Queue: queue, Holder: "other", Limit: 1, TTL: time.Minute})
	if err != nil {
		t.Error(err)
		return 0
	}
	if len(js) == 0 {
		return 0
	}
	if js[0].ID != id {
		t.Errorf("claimed job %d, want %d", js[0].ID, id)
	}
	return js[0].ClaimToken
}

// TestOutcomeReplyLostIsNoLoss: the Worker's outcome statement (a release
// at shutdown, a failure, a completion) commits but its reply is lost with
// the connection, and before the retry (10 ms later) another worker claims
// the job again (the job was released, or failed with a retry at once) or
// the job, finished, is purged. The retry finds the claim gone. The claim
// could not have expired: its local deadline, counted from before the
// claim was sent, is a minute away; so the first attempt ended it, and the
// outcome counts as written, not as a lost claim. The Worker counted a
// claim lost and called OnClaimLost: a false report.
func TestOutcomeReplyLostIsNoLoss(t *testing.T) {
	t.Parallel()
	for _, c := range lostReplyCases() {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			replyLost(t, c, time.Minute, nil)
		})
	}
}

// TestOutcomeReplyLostAfterRenewalsIsNoLoss: as TestOutcomeReplyLostIsNoLoss
// (a failure), for a claim renewed past the TTL it was taken with: its local
// deadline counts from the latest renewal, not from the claim.
func TestOutcomeReplyLostAfterRenewalsIsNoLoss(t *testing.T) {
	t.Parallel()
	c := lostReplyCases()[1]
	if c.name != "fail" {
		t.Fatalf("case %q, want fail", c.name)
	}
	replyLost(t, c, 0, func(t *testing.T, ctx context.Context, admin *pgxpool.Pool, r *outcomeRun, ttl time.Duration) {
		// The handler runs past the claim's first deadline (a duration of
		// the scenario, not a wait for an event), its claim renewed every
		// ttl/3.
		time.Sleep(time.Until(r.started.Add(ttl + ttl/3)))
		j := mustJob(t, admin, r.job.ID)
		if j.State != skiplocked.StateRunning || j.ClaimToken != r.job.ClaimToken || !j.ClaimExpiresAt.After(r.job.ClaimExpiresAt) {
			t.Fatalf("job %+v after %s; want running under token %d, its claim renewed past %s",
				j, time.Since(r.started), r.job.ClaimToken, r.job.ClaimExpiresAt)
		}
	})
}

// replyLost runs a case of TestOutcomeReplyLostIsNoLoss with claims of ttl
// (0: scaled from a round trip to the database), hold (if set) called
// before the handler returns.
func replyLost(t *testing.T, c lostReplyCase, ttl time.Duration,
	hold func(t *testing.T, ctx context.Context, admin *pgxpool.Pool, r *outcomeRun, ttl time.Duration)) {
	ctx := ctxT(t)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	queue := "lost-reply-" + c.name
	id := enqueueN(t, admin, queue, 1, 5)[0]
	if ttl == 0 {
		ttl = max(1500*time.Millisecond, 150*roundTrip(t, ctx, admin)).Round(time.Millisecond)
	}

	f := newOutcomeFaults(c.target)
	var reclaimed atomic.Int64
	f.afterCommit = func() {
		// Between the commit and the retry: the job is taken, or gone,
		// before the Worker looks again.
		switch c.name {
		case "release", "fail":
			reclaimed.Store(claimAgain(t, ctx, admin, queue, id))
		default: // finished: purged at once
			if n, err := skiplocked.DeleteFinished(ctx, admin, time.Now().Add(time.Hour), 10); err != nil || n != 1 {
				t.Errorf("DeleteFinished = %d, %v; want the finished job deleted", n, err)
			}
		}
	}
	r := startOutcomeRun(t, ctx, faultPool(t, dsn, f), queue, c, ttl)
	if hold != nil {
		hold(t, ctx, admin, r, ttl)
	}
	stopped := make(chan error, 1)
	r.finish(c, stopped)
	select {
	case <-f.cut:
	case <-ctx.Done():
		t.Fatal("the outcome statement was never cut")
	}
	if c.shutdown {
		if err := <-stopped; err != nil {
			t.Fatal(err)
		}
	} else {
		waitFor(t, "the outcome counted", func() bool { s := r.w.Summary(); return c.count(s)+s.ClaimsLost+s.Unknown > 0 })
		if err := r.stop(); err != nil {
			t.Fatal(err)
		}
	}
	if f.replyErr.Load() {
		t.Fatal("the first attempt's reply was an error: it did not commit")
	}
	switch c.name {
	case "release", "fail":
		if reclaimed.Load() == 0 {
			t.Fatal("the job was not claimable once the first attempt committed")
		}
		if j := mustJob(t, admin, id); j.State != skiplocked.StateRunning || j.ClaimToken != reclaimed.Load() {
			t.Fatalf("job %+v; want running under the other worker's token %d", j, reclaimed.Load())
		}
	default:
		if _, err := skiplocked.GetJob(ctx, admin, id); !errors.Is(err, pgfence.ErrNotFound) {
			t.Fatalf("GetJob after the purge: %v; want ErrNotFound", err)
		}
	}
	sum := r.w.Summary()
	if sum.ClaimsLost != 0 || len(r.lost) != 0 || sum.Unknown != 0 || c.count(sum) != 1 {
		var hook *pgfence.Error
		if len(r.lost) > 0 {
			hook = <-r.lost
		}
		t.Fatalf("summary %+v, OnClaimLost %v; want the %s counted once, no claim lost, no OnClaimLost call "+
			"(the first attempt committed before the claim's local deadline)", sum, hook, c.name)
	}
}

// TestOutcomeLostAfterDeadlineIsLoss: the counterpart of
// TestOutcomeReplyLostIsNoLoss for a claim really lost. Renewals fail; the
// Worker's outcome statement is sent but never reaches the server (the
// client cannot tell that from a lost reply); the claim runs out, on the
// database and on the Worker's clock, another worker claims the job again,
// and only then the connection fails. The retry finds the job claimed
// again after the claim's local deadline: a lost claim, reported to
// OnClaimLost, as before.
func TestOutcomeLostAfterDeadlineIsLoss(t *testing.T) {
	t.Parallel()
	for _, c := range lostReplyCases() {
		if c.name == "fail-dead" {
			continue // the same statement as "fail"
		}
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := ctxT(t)
			dsn := pgtest.DSN(t)
			admin := pgtest.PoolFor(t, dsn)
			queue := "lost-claim-" + c.name
			id := enqueueN(t, admin, queue, 1, 5)[0]
			// The outcome statement is out for about half the TTL plus the
			// time to claim the job again, and its retries must be done
			// within the TTL (the Worker gives up on them then).
			ttl := max(1500*time.Millisecond, 150*roundTrip(t, ctx, admin)).Round(time.Millisecond)

			f := newOutcomeFaults(c.target)
			f.blackhole = true
			f.noRenew = true
			r := startOutcomeRun(t, ctx, faultPool(t, dsn, f), queue, c, ttl)
			defer func() {
				select {
				case <-f.cutNow:
				default:
					close(f.cutNow)
				}
			}()
			// The handler runs for half the claim (the outcome then has the
			// other half to be retried in), then the outcome is sent, and
			// dropped. (A duration of the scenario, not a wait for an
			// event.)
			time.Sleep(time.Until(r.started.Add(ttl / 2)))
			stopped := make(chan error, 1)
			r.finish(c, stopped)
			select {
			case <-f.sent:
			case <-ctx.Done():
				t.Fatal("the outcome statement was never sent")
			}
			// The claim runs out (no renewal extends it): another worker
			// claims the job, and then the dropped statement's connection
			// fails.
			// Polled: the expiry is a time on the database clock, nothing
			// signals it.
			var token int64
			for giveUp := time.Now().Add(ttl + 10*time.Second); ; time.Sleep(10 * time.Millisecond) {
				if token = claimAgain(t, ctx, admin, queue, id); token != 0 {
					break
				}
				if time.Now().After(giveUp) {
					t.Fatalf("the job was not claimable %s after its claim was sent with a TTL of %s", time.Since(r.started), ttl)
				}
			}
			close(f.cutNow)
			if c.shutdown {
				if err := <-stopped; err != nil {
					t.Fatal(err)
				}
			} else {
				waitFor(t, "the outcome counted", func() bool { s := r.w.Summary(); return c.count(s)+s.ClaimsLost+s.Unknown > 0 })
				if err := r.stop(); err != nil { // Run returns after OnClaimLost did
					t.Fatal(err)
				}
			}
			sum := r.w.Summary()
			if sum.ClaimsLost != 1 || len(r.lost) != 1 || c.count(sum) != 0 || sum.Unknown != 0 {
				t.Fatalf("summary %+v, %d OnClaimLost calls; want one claim lost, reported once, and no %s", sum, len(r.lost), c.name)
			}
			if hook := <-r.lost; !errors.Is(hook, pgfence.ErrLost) || hook.Token != r.job.ClaimToken {
				t.Errorf("OnClaimLost got %v; want ErrLost for token %d", hook, r.job.ClaimToken)
			}
			if j := mustJob(t, admin, id); j.State != skiplocked.StateRunning || j.ClaimToken != token {
				t.Errorf("job %+v; want running under the other worker's token %d", j, token)
			}
		})
	}
}
