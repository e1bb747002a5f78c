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
type keeper struct {
	l    *Locker
	wake chan struct{} // a lease was added

	mu      sync.Mutex
	due     map[*Lease]time.Time // the next renewal of each lease kept alive
	started bool
}

func newKeeper(l *Locker) *keeper {
	return &keeper{l: l, wake: make(chan struct{}, 1), due: map[*Lease]time.Time{}}
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
	k.due[s] = s.grantedAt.Add(jitter(k.interval(s)))
	start := !k.started
	k.started = true
	k.mu.Unlock()
	if start {
		k.l.wg.Add(1)
		go k.run()
	}
	select {
	case k.wake <- struct{}{}:
	default:
	}
}

// remove stops keeping s alive (it ended, or is being released).
func (k *keeper) remove(s *Lease) {
	k.mu.Lock()
	delete(k.due, s)
	k.mu.Unlock()
}

// run renews due leases until the Locker closes.
func (k *keeper) run() {
	defer k.l.wg.Done()
	// ctx ends when the Locker closes, ending a statement in flight.
	ctx, cancel := context.WithCancel(context.Background())
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
		batch, next := k.take(time.Now())
		if len(batch) > 0 {
			k.renew(ctx, batch)
			continue
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

// take returns, once the earliest due renewal has come (now or before), the
// leases due within half their interval of now, sorted by name (one lock
// order for every statement); before that, none. next is the earliest due
// time of the leases it leaves (zero if none). Ticking only when a renewal
// is due, never when a lease is added, keeps ticks at least half an
// interval apart: a tick takes every lease due before the next one.
func (k *keeper) take(now time.Time) (batch []*Lease, next time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, due := range k.due {
		if next.IsZero() || due.Before(next) {
			next = due
		}
	}
	if next.IsZero() || next.After(now) {
		return nil, next
	}
	next = time.Time{}
	for s, due := range k.due {
		if !due.After(now.Add(k.interval(s) / 2)) {
			batch = append(batch, s)
		} else if next.IsZero() || due.Before(next) {
			next = due
		}
	}
	slices.SortFunc(batch, func(a, b *Lease) int {
		return cmp.Or(cmp.Compare(a.name, b.name), cmp.Compare(a.token, b.token))
	})
	return batch, next
}

// renew renews batch, maxRenewBatch leases per statement, and schedules
// each lease's next renewal.
func (k *keeper) renew(ctx context.Context, batch []*Lease) {
	for len(batch) > 0 {
		n := min(len(batch), maxRenewBatch)
		k.renewChunk(ctx, batch[:n])
		batch = batch[n:]
	}
}

type leaseID struct {
	name  string
	token int64
}

func (k *keeper) renewChunk(ctx context.Context, chunk []*Lease) {
	const op = "pglock.Renew"
	l := k.l
	p := dbsqlc.RenewLocksParams{Key: l.key}
	var deadline time.Time
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
		if !time.Now().Before(d) {
			// Ended locally: its deadline timer ends it; never extend it.
			k.reschedule(s, time.Now().Add(k.retry(s)))
			continue
		}
		if d.After(deadline) {
			deadline = d
		}
		live = append(live, s)
		p.Names = append(p.Names, s.name)
		p.Tokens = append(p.Tokens, s.token)
		p.TtlsUs = append(p.TtlsUs, s.ttl.Microseconds())
	}
	if len(live) == 0 {
		return
	}
	// The statement may not outlast the latest local deadline among them: an
	// answer after it could extend none of them. (Not the earliest: one
	// lease about to end would cut the statement of every lease it shares,
	// tick after tick; a lease whose deadline passes while the statement is
	// out ends below, whatever the answer.)
	rctx, cancel := context.WithDeadline(ctx, deadline)
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
		l.log.Warn("pglock: keep-alive renewal failed; retrying until the local deadlines",
			"leases", len(live), "err", dbError(op, live[0].name, err))
		for _, s := range live {
			l.m.Add(ctx, metricdefs.LeaseRenewalsTotal, 1, metricdefs.RenewError)
			s.mu.Lock()
			s.renewFailing = true
			s.mu.Unlock()
			k.reschedule(s, time.Now().Add(k.retry(s)))
		}
		return
	}
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
			k.reschedule(s, next)
		}
	}
}

// reschedule sets the next renewal of s, if it is still kept alive.
func (k *keeper) reschedule(s *Lease, at time.Time) {
	k.mu.Lock()
	if _, ok := k.due[s]; ok {
		k.due[s] = at
	}
	k.mu.Unlock()
}
