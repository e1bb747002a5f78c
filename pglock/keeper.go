package pglock

import (
	"cmp"
	"context"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/metricdefs"
)

// maxRenewBatch is the most leases one keep-alive statement renews: the
// bound of pgfence.lock_renew_many's arrays. A Locker with more leases due
// at once sends one statement per maxRenewBatch of them.
const maxRenewBatch = 10000

// keeper renews the leases of a Locker with Config.KeepAlive: one goroutine
// per Locker, which sends every lease due for renewal in one statement per
// tick (pgfence.lock_renew_many), however many leases the Locker holds.
//
// A lease is due at KeepAliveFraction of its TTL (±10%) after the send time
// of its grant or latest renewal, the instant its local deadline counts
// from. When the earliest due renewal comes, a tick renews every lease due
// within half of its interval from then, so leases acquired at different
// moments share statements: a tick renews some leases up to half an
// interval early (renewing early only extends a lease), ticks are at least
// half an interval apart, and a Locker sends at most about two statements
// per interval.
//
// The goroutine never waits for a statement: each runs in a goroutine of
// its own, and a lease is in at most one statement at a time. Leases that
// fall due while a statement is out go in the next tick's statement, so a
// statement that gets no answer (a connection black-holed after a
// failover, a lock row locked in the database) holds back only its own
// leases, and those only until its limit (renewLimit). Then it is
// cancelled (with pgx's default, that closes its connection): its outcome
// is unknown, so it extends no lease (the database may have committed it;
// renewals are conditional and never move an expiry earlier, so renewing
// again is harmless). Its leases are tried again at once, apart from every
// other lease, in two statements of half of them each (one, for one lease
// or past maxRetryGroups), each with a limit of its own, on other
// connections; they stay apart (a retry group each) until a renewal of
// theirs is answered. A lease whose row stays locked thus holds back fewer
// leases at each try. Close cancels the statements out and waits for them.
type keeper struct {
	l    *Locker
	wake chan struct{} // a lease was added, or a statement returned

	mu      sync.Mutex
	kept    map[*Lease]*keptLease // the leases kept alive
	groups  uint64                // the last retry group numbered
	rtt     time.Duration         // the round trip of a renewal statement, as measured (see measure)
	timed   bool                  // rtt was measured on a renewal, not on grants
	started bool
}

// keptLease is the keep-alive state of one lease (under keeper.mu).
type keptLease struct {
	next  time.Time // its next renewal is due
	group uint64    // 0, or the retry group it was put in when a statement with it got no answer in time
	out   bool      // a statement with it is out (or being made)
}

// batch is the leases of one statement, all of retry group group.
type batch struct {
	group  uint64
	leases []*Lease
}

func newKeeper(l *Locker) *keeper {
	return &keeper{l: l, wake: make(chan struct{}, 1), kept: map[*Lease]*keptLease{}}
}

// interval is the time between renewals of s.
func (k *keeper) interval(s *Lease) time.Duration {
	return time.Duration(float64(s.ttl) * k.l.cfg.KeepAliveFraction)
}

// retry is the time before a renewal that failed on the connection is
// tried again.
func (k *keeper) retry(s *Lease) time.Duration {
	return max(min(k.interval(s)/4, 500*time.Millisecond), time.Millisecond)
}

// add keeps s alive from now on; the caller holds l.mu with l not closed
// (so the goroutine is counted in l.wg before Close waits on it).
func (k *keeper) add(s *Lease) {
	k.mu.Lock()
	k.kept[s] = &keptLease{next: s.grantedAt.Add(jitter(k.interval(s)))}
	if !k.timed {
		// Until a renewal is timed, the grants' round trips stand for it:
		// from the send time to now, which is no shorter.
		k.rtt = max(k.rtt, time.Since(s.grantedAt))
	}
	start := !k.started
	k.started = true
	k.mu.Unlock()
	if start {
		k.l.wg.Add(1)
		go k.run()
	}
	k.poke()
}

// poke wakes the goroutine to look at the leases again.
func (k *keeper) poke() {
	select {
	case k.wake <- struct{}{}:
	default:
	}
}

// remove stops keeping s alive (it ended, or is being released).
func (k *keeper) remove(s *Lease) {
	k.mu.Lock()
	delete(k.kept, s)
	k.mu.Unlock()
}

// settle ends the part of s in a statement: its next renewal is due at
// next, in retry group group (0: with every other lease), if s is still kept
// alive.
func (k *keeper) settle(s *Lease, next time.Time, group uint64) {
	k.mu.Lock()
	if e := k.kept[s]; e != nil {
		e.out, e.next, e.group = false, next, group
	}
	k.mu.Unlock()
}

// measure takes the round trip d of a renewal statement into the estimate:
// a longer one at once, a shorter one by an eighth of the difference, so a
// slow network raises it at once and one fast answer does not lower it.
func (k *keeper) measure(d time.Duration) {
	k.mu.Lock()
	if !k.timed || d > k.rtt {
		k.rtt = d
	} else {
		k.rtt -= (k.rtt - d) / 8
	}
	k.timed = true
	k.mu.Unlock()
}

// run renews due leases until the Locker closes, and returns once the
// statements it sent have returned.
func (k *keeper) run() {
	defer k.l.wg.Done()
	// ctx ends when the Locker closes, ending the statements out.
	ctx, cancel := context.WithCancel(context.Background())
	var out sync.WaitGroup
	defer out.Wait()
	defer cancel()
	go func() {
		select {
		case <-k.l.closedCh:
			cancel()
		case <-ctx.Done():
		}
	}()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		batches, next := k.take(time.Now())
		for _, b := range batches {
			for len(b.leases) > 0 {
				n := min(len(b.leases), maxRenewBatch)
				k.send(ctx, &out, b.group, b.leases[:n])
				b.leases = b.leases[n:]
			}
		}
		wait := time.Hour
		if !next.IsZero() {
			wait = max(time.Until(next), 0)
		}
		timer.Reset(wait)
		select {
		case <-k.l.closedCh:
			return
		case <-k.wake:
		case <-timer.C:
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
	}
}

// take returns the statements to send now, each lease sorted by name (one
// lock order for every statement), and marks their leases out. Leases of
// retry group 0 go together once the earliest due renewal among them has
// come (now or before): every one due within half its interval of now;
// before that, none. Ticking only when a renewal is due, never when a lease
// is added, keeps ticks at least half an interval apart: a tick takes every
// lease due before the next one. The leases of each other retry group that
// are due go in a statement of their own. next is the earliest due time of
// the leases it leaves that are not out (zero if none).
func (k *keeper) take(now time.Time) (batches []batch, next time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	var first time.Time // the earliest due renewal of group 0
	for _, e := range k.kept {
		if !e.out && e.group == 0 && (first.IsZero() || e.next.Before(first)) {
			first = e.next
		}
	}
	tick := !first.IsZero() && !first.After(now)
	var groups map[uint64]int // index in batches
	for s, e := range k.kept {
		switch {
		case e.out:
			continue
		case e.group == 0 && tick && !e.next.After(now.Add(k.interval(s)/2)),
			e.group != 0 && !e.next.After(now):
			if groups == nil {
				groups = map[uint64]int{}
			}
			i, ok := groups[e.group]
			if !ok {
				i = len(batches)
				groups[e.group] = i
				batches = append(batches, batch{group: e.group})
			}
			batches[i].leases = append(batches[i].leases, s)
			e.out = true
		case next.IsZero() || e.next.Before(next):
			next = e.next
		}
	}
	for _, b := range batches {
		slices.SortFunc(b.leases, func(a, b *Lease) int {
			return cmp.Or(cmp.Compare(a.name, b.name), cmp.Compare(a.token, b.token))
		})
	}
	return batches, next
}

// send sends one statement renewing chunk (leases of retry group group,
// marked out) in a goroutine counted in out.
func (k *keeper) send(ctx context.Context, out *sync.WaitGroup, group uint64, chunk []*Lease) {
	l := k.l
	now := time.Now()
	p := dbsqlc.RenewLocksParams{Key: l.key}
	var (
		latest time.Time     // the latest local deadline among them
		left   time.Duration // the shortest remaining local time among them
		retry  time.Duration // the shortest retry interval among them
	)
	live := chunk[:0:0]
	for _, s := range chunk {
		s.mu.Lock()
		skip := s.err != nil || s.releasing
		d := s.deadline
		s.mu.Unlock()
		if skip {
			k.remove(s)
			continue
		}
		if !now.Before(d) {
			// Ended locally: its deadline timer ends it; never extend it.
			k.settle(s, now.Add(k.retry(s)), group)
			continue
		}
		if len(live) == 0 || d.After(latest) {
			latest = d
		}
		if len(live) == 0 || d.Sub(now) < left {
			left = d.Sub(now)
		}
		if len(live) == 0 || k.retry(s) < retry {
			retry = k.retry(s)
		}
		live = append(live, s)
		p.Names = append(p.Names, s.name)
		p.Tokens = append(p.Tokens, s.token)
		p.TtlsUs = append(p.TtlsUs, s.ttl.Microseconds())
	}
	if len(live) == 0 {
		return
	}
	k.mu.Lock()
	rtt := k.rtt
	k.mu.Unlock()
	limit := now.Add(renewLimit(left, retry, rtt))
	if limit.After(latest) {
		limit = latest
	}
	out.Add(1)
	go func() {
		defer out.Done()
		defer k.poke()
		k.renew(ctx, group, live, p, now, limit)
	}()
}

// renewLimit is how long a statement whose leases have left before their
// earliest local deadline waits for its answer before it is cut and tried
// again (the caller also stops it at the latest local deadline among them:
// an answer after it extends none of them). Half of left keeps the other
// half for the retry, which may need a new connection; but at least four
// measured round trips rtt, and the shortest retry interval among them
// (retry): a statement on a slow network is not cut before it could
// answer, nor when its retry could not be answered in time either, and a
// lease about to end does not cut the statement of every lease it shares,
// tick after tick.
func renewLimit(left, retry, rtt time.Duration) time.Duration {
	return max(left/2, 4*rtt, retry)
}

// maxRetryGroups bounds splitting: a statement that got no answer in time
// is retried in two halves only while the keeper has fewer retry groups than
// this, else as one. However many leases get no answer, the retries do not
// multiply past it (in a total outage each tick's statement adds one group,
// not a fan of them); a lease whose row stays locked then holds back about
// 1/maxRetryGroups of the leases of its statement, at the fewest.
const maxRetryGroups = 8

// retryGroups is the number of retry groups; the caller holds k.mu.
func (k *keeper) retryGroups() int {
	groups := map[uint64]struct{}{}
	for _, e := range k.kept {
		if e.group != 0 {
			groups[e.group] = struct{}{}
		}
	}
	return len(groups)
}

type leaseID struct {
	name  string
	token int64
}

// renew sends one renewal statement for live (p), made at start, waiting
// for its answer until limit, and schedules each lease's next renewal.
func (k *keeper) renew(ctx context.Context, group uint64, live []*Lease, p dbsqlc.RenewLocksParams, start, limit time.Time) {
	const op = "pglock.Renew"
	l := k.l
	rctx, cancel := context.WithDeadline(ctx, limit)
	defer cancel()
	var (
		rows []dbsqlc.RenewLocksRow
		sent time.Time
	)
	err := l.onLiveConn(rctx, func(conn *pgxpool.Conn) (err error) {
		sent = time.Now() // a renewal applied twice only extends the leases again
		rows, err = l.q.RenewLocks(rctx, oneRoundTrip{conn}, p)
		return err
	})
	if err != nil {
		if ctx.Err() != nil {
			return // the Locker is closing
		}
		for _, s := range live {
			l.m.Add(ctx, metricdefs.LeaseRenewalsTotal, 1, metricdefs.RenewError)
			s.mu.Lock()
			s.renewFailing = true
			s.mu.Unlock()
		}
		now := time.Now()
		if rctx.Err() == nil {
			l.log.Warn("pglock: keep-alive renewal failed; retrying until the local deadlines",
				"leases", len(live), "err", dbError(op, live[0].name, err))
			for _, s := range live {
				k.settle(s, now.Add(k.retry(s)), group)
			}
			return
		}
		// No answer in time: the outcome is unknown (the server may still
		// commit it), so it extends nothing. Retried at once, apart from the
		// other leases, in two halves (while there are fewer than
		// maxRetryGroups), each on a connection of its own: the cancelled
		// statement closed its connection.
		l.log.Warn("pglock: keep-alive renewal got no answer in time; retrying at once on other connections",
			"leases", len(live), "waited", now.Sub(start).Round(time.Millisecond), "err", dbError(op, live[0].name, err))
		halves := [][]*Lease{live}
		k.mu.Lock()
		if h := len(live) / 2; h > 0 && k.retryGroups() < maxRetryGroups {
			halves = [][]*Lease{live[:h], live[h:]}
		}
		for _, half := range halves {
			k.groups++
			for _, s := range half {
				if e := k.kept[s]; e != nil {
					e.out, e.next, e.group = false, now, k.groups
				}
			}
		}
		k.mu.Unlock()
		return
	}
	k.measure(time.Since(sent))
	renewed := make(map[leaseID]time.Time, len(rows))
	for _, r := range rows {
		renewed[leaseID{r.Name, r.Token}] = r.ExpiresAt
	}
	for _, s := range live {
		exp, ok := renewed[leaseID{s.name, s.token}]
		s.mu.Lock()
		switch {
		case s.err != nil || s.releasing:
			s.mu.Unlock()
			k.remove(s)
		case !ok:
			// Refused: the lease expired, was released or granted again.
			s.mu.Unlock()
			k.remove(s)
			l.m.Add(ctx, metricdefs.LeaseRenewalsTotal, 1, metricdefs.RenewRefused)
			s.end(s.lost(op, nil))
		case !time.Now().Before(s.deadline):
			// The old deadline passed while the statement was out: the
			// lease has ended locally, whatever the database says now.
			s.mu.Unlock()
			k.remove(s)
			s.end(s.lost(op, errDeadline))
		default:
			s.expiresAt = exp
			s.renewFailing = false
			if d := sent.Add(s.ttl); d.After(s.deadline) {
				s.deadline = d
				s.timer.Reset(time.Until(d))
			}
			next := s.deadline.Add(jitter(k.interval(s)) - s.ttl)
			s.mu.Unlock()
			l.m.Add(ctx, metricdefs.LeaseRenewalsTotal, 1, metricdefs.RenewOK)
			k.settle(s, next, 0)
		}
	}
}
