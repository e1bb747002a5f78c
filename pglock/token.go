package pglock

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
)

// RenewToken extends the lease (name, token) held with this Locker's key to
// ttl from now (database clock) and returns the new expiry: the stateless
// form of [Lease.Renew] for callers that have only the values (a Locker with
// the same [Config.Key] as the one granted the lease). A lease that is no
// longer held by exactly that token and key gives a [*pgfence.Error]
// matching [pgfence.ErrLost] and nothing changes.
func (l *Locker) RenewToken(ctx context.Context, name string, token int64, ttl time.Duration) (time.Time, error) {
	const op = "pglock.RenewToken"
	if err := validatePair(op, name, token); err != nil {
		return time.Time{}, err
	}
	if err := validateTTL(op, ttl); err != nil {
		return time.Time{}, err
	}
	exp, _, err := l.renew(ctx, op, name, token, ttl)
	return exp, err
}

// ReleaseToken releases the lease (name, token) held with this Locker's key:
// the row keeps its token, holder and expiry become NULL, and waiters are
// notified (or the first one is handed the lease). If the lease is no longer
// held by exactly that token and key, nothing changes and the error is a
// [*pgfence.Error] matching [pgfence.ErrLost]. A live [Lease] of this
// Locker on that grant ends with [pgfence.ErrLost] once it is released.
func (l *Locker) ReleaseToken(ctx context.Context, name string, token int64) error {
	const op = "pglock.ReleaseToken"
	if err := validatePair(op, name, token); err != nil {
		return err
	}
	return l.release(ctx, op, name, token)
}

// Adopt returns a [Lease] for a grant of name under this Locker's key that
// the caller has no Lease for: one found with [Inspect] after an acquisition
// with an unknown outcome, or left by an earlier run with the same
// [Config.Key]. It renews (name, token) to ttl conditionally; a grant no
// longer held with this key gives a [*pgfence.Error] matching
// [pgfence.ErrLost] and nothing changes. Adopt never creates a grant nor
// changes the token. A (name, token) with a live Lease in this Locker, or
// that another Adopt is turning into one, gives [pgfence.ErrInvalid]; one
// this Locker is giving back (a grant whose call gave up before it was
// answered) gives [pgfence.ErrLost]; a renewal answered after ttl gives
// [pgfence.ErrSlowGrant] (the grant is left to expire, or given back if
// this Locker was about to). A renewal answered after [Locker.Close] began
// gives [pgfence.ErrClosed], and the grant is given back. A grant released
// while Adopt renews it (by an ended Lease of it, or [Locker.ReleaseToken])
// gives [pgfence.ErrLost]. Config.KeepAlive applies.
func (l *Locker) Adopt(ctx context.Context, name string, token int64, ttl time.Duration) (*Lease, error) {
	const op = "pglock.Adopt"
	if err := validatePair(op, name, token); err != nil {
		return nil, err
	}
	if err := validateTTL(op, ttl); err != nil {
		return nil, err
	}
	if !l.calls.enter() { // Close waits for the call, and for its give-backs
		return nil, closedError(op, name)
	}
	defer l.calls.done()
	switch l.claim(claimAdopt, name, token) {
	case claimAdopt:
		return nil, invalid(op, "token", "lock %q token %d already has a live Lease in this Locker, or another Adopt is making one; use it", name, token)
	case claimGiveBack:
		e := lostError(op, name, l.holder, token, nil)
		e.Reason = "this Locker is giving the grant back: nobody held a Lease for it"
		return nil, e
	}
	var (
		lease              *Lease
		err                error
		giveBack, released bool
	)
	func() {
		// Unclaimed also if a pool hook or tracer panics under the renewal.
		defer func() { giveBack, released = l.unclaim(name, token) }()
		lease, err = l.adopt(ctx, op, name, token, ttl)
	}()
	if released && lease != nil {
		// A Lease of this grant that had ended, or ReleaseToken, released
		// it while this Adopt renewed it: the new Lease holds nothing.
		e := releasedElsewhere(name, l.holder, token)
		e.Op = op
		lease.end(e)
		return nil, e
	}
	if giveBack && lease == nil && !errors.Is(err, pgfence.ErrLost) {
		// A give-back of the grant left it to this Adopt, which made no
		// Lease of it: give it back now.
		l.giveBack(ctx, op, name, token, "pglock: release of a grant nobody holds a Lease for, after a failed Adopt")
	}
	return l.giveBackIfClosed(ctx, op, lease, err)
}

// adopt is Adopt once it holds the grant's claim: it renews the grant and
// registers its Lease.
func (l *Locker) adopt(ctx context.Context, op, name string, token int64, ttl time.Duration) (*Lease, error) {
	exp, sent, err := l.renew(ctx, op, name, token, ttl)
	if err != nil {
		return nil, err
	}
	if took := time.Since(sent); took >= ttl {
		return nil, slowGrantError(op, name, token, took, ttl, "it is left to expire")
	}
	if l.log.Enabled(context.Background(), slog.LevelInfo) {
		l.log.Info("pglock: adopted", "name", name, "token", token, "ttl", ttl, "expires_at", exp)
	}
	return l.newLease(name, token, ttl, exp, sent), nil
}

func validatePair(op, name string, token int64) error {
	if err := validateName(op, name); err != nil {
		return err
	}
	return validateToken(op, token)
}

func (l *Locker) renew(ctx context.Context, op, name string, token int64, ttl time.Duration) (expiresAt time.Time, sent time.Time, err error) {
	var row dbsqlc.RenewLockRow
	err = l.onLiveConn(ctx, func(conn *pgxpool.Conn) (err error) {
		sent = time.Now() // a renewal applied twice only extends the lease again
		row, err = l.q.RenewLock(ctx, oneRoundTrip{conn}, dbsqlc.RenewLockParams{Name: name, Token: token, Key: l.key, TtlUs: ttl.Microseconds()})
		return err
	})
	switch {
	case err != nil:
		return time.Time{}, sent, dbError(op, name, err)
	case row.ExpiresAt == nil:
		return time.Time{}, sent, lostError(op, name, l.holder, token, nil)
	}
	return *row.ExpiresAt, sent, nil
}

// onLiveConn runs f on a pooled connection, and runs it again on another one
// (up to maxDeadConns times) when it failed because its connection was dead
// (see deadConnection).
func (l *Locker) onLiveConn(ctx context.Context, f func(*pgxpool.Conn) error) error {
	for deadConns := 0; ; deadConns++ {
		conn, err := l.pool.Acquire(ctx)
		if err != nil {
			return err
		}
		retry := false
		func() {
			defer conn.Release() // also if f panics (user code runs under it: tracers)
			err = f(conn)
			retry = err != nil && deadConns < maxDeadConns && ctx.Err() == nil && deadConnection(conn, err)
		}()
		if !retry {
			return err
		}
	}
}

// oneRoundTrip runs statements with pgx.QueryExecModeExec, never spending a
// prepare round trip out of the lease's remaining time (renewals use it; the
// statements' parameters all carry casts).
type oneRoundTrip struct{ db pgfence.DBTX }

func (o oneRoundTrip) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return o.db.Exec(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
}

func (o oneRoundTrip) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return o.db.Query(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
}

func (o oneRoundTrip) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return o.db.QueryRow(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
}

// release ends the lease (name, token) held with the Locker's key
// (pgfence.lock_release, which hands it to the first live waiter if there is
// one). A lost lease is an error of kind pgfence.ErrLost; op is the exported
// call, for errors.
func (l *Locker) release(ctx context.Context, op, name string, token int64) error {
	return l.releaseGrant(ctx, op, name, token, nil)
}

// releaseGrant is release for the Lease self (nil: for no Lease). Once the
// database has released the grant, no other Lease of this Locker holds it:
// grantReleased ends them.
func (l *Locker) releaseGrant(ctx context.Context, op, name string, token int64, self *Lease) error {
	// Coalesced with the other releases of this Locker (coalesce.go).
	r, _, err := l.releases.do(ctx, releaseReq{name: name, token: token})
	switch {
	case err != nil:
		return dbError(op, name, err)
	case !r.Released:
		return lostError(op, name, l.holder, token, nil)
	}
	l.grantReleased(name, token, self)
	if (r.HandedOff || r.Notified) && !l.isHot(name) {
		// Waited for: the next Acquire through this Locker queues at once.
		l.setHot(name, true)
	}
	return nil
}

// grantReleased ends every live Lease of this Locker on the grant (name,
// token) but self, after a release of that grant succeeded: a Lease that
// had ended locally (its deadline passed while the database kept the grant)
// can still release it, as can ReleaseToken, after Adopt made a new Lease
// of the same grant; that Lease would otherwise stay live while another
// holder takes the name. An Adopt of the grant still under way is told
// through its claim (Adopt ends the Lease it made).
func (l *Locker) grantReleased(name string, token int64, self *Lease) {
	var others []*Lease
	l.mu.Lock()
	if c := l.claims[grantID{name, token}]; c != nil && c.kind == claimAdopt {
		c.released = true
	}
	for s := range l.leases {
		if s != self && s.name == name && s.token == token && s.state() == nil {
			others = append(others, s)
		}
	}
	l.mu.Unlock()
	for _, s := range others {
		s.end(releasedElsewhere(s.name, s.holder, s.token))
	}
}

// releasedElsewhere is the end of a Lease whose grant another Lease of the
// same grant, or ReleaseToken, released.
func releasedElsewhere(name, holder string, token int64) *pgfence.Error {
	e := lostError("pglock.Release", name, holder, token, nil)
	e.Reason = "released through another Lease of the same grant, or ReleaseToken"
	return e
}

// grantID names one grant: a lock name and its token.
type grantID struct {
	name  string
	token int64
}

// claimKind says who claimed a grant (claim).
type claimKind uint8

const (
	claimAdopt    claimKind = iota + 1 // Adopt turns it into a Lease
	claimGiveBack                      // a give-back releases it (nobody holds a Lease for it)
)

// grantClaim is a claim on a grant (claim).
type grantClaim struct {
	kind claimKind
	// giveBack: a give-back found this Adopt's claim and left the grant to
	// it; if the Adopt makes no Lease, the grant is given back after all.
	giveBack bool
	// released: a release of the grant succeeded during this Adopt's claim
	// (grantReleased); the Lease the Adopt made holds nothing.
	released bool
}

// claim reserves the grant (name, token) for an Adopt or a give-back, so
// that the two cannot both act on it: a give-back checked that no Lease
// held it, an Adopt then renewed it into a Lease, and the give-back's
// release ended that Lease's grant. It returns the kind that holds the
// grant already (0 when the claim is taken): a give-back also finds a live
// Lease on it as claimAdopt. A give-back that finds an Adopt's claim is
// recorded on it (see unclaim). Unclaim with unclaim.
func (l *Locker) claim(kind claimKind, name string, token int64) (held claimKind) {
	id := grantID{name, token}
	l.mu.Lock()
	if c := l.claims[id]; c != nil {
		held = c.kind
		if held == claimAdopt && kind == claimGiveBack {
			c.giveBack = true
		}
	} else if l.hasLiveLocked(name, token) {
		held = claimAdopt
	} else {
		if l.claims == nil {
			l.claims = map[grantID]*grantClaim{}
		}
		l.claims[id] = &grantClaim{kind: kind}
	}
	hook := l.claimHook
	l.mu.Unlock()
	if held == 0 && hook != nil {
		hook(kind, name, token)
	}
	return held
}

// unclaim ends a claim taken with claim. For an Adopt's claim it reports
// whether a give-back left the grant to it while no live Lease holds it
// now: the Adopt failed, and the grant must be given back; and whether a
// release of the grant succeeded meanwhile (grantReleased).
func (l *Locker) unclaim(name string, token int64) (giveBack, released bool) {
	id := grantID{name, token}
	l.mu.Lock()
	defer l.mu.Unlock()
	if c := l.claims[id]; c != nil {
		giveBack = c.giveBack && !l.hasLiveLocked(name, token)
		released = c.released
	}
	delete(l.claims, id)
	return giveBack, released
}

// hasLiveLocked reports whether the Locker has a live Lease on (name,
// token); l.mu is held.
func (l *Locker) hasLiveLocked(name string, token int64) bool {
	for s := range l.leases {
		if s.name == name && s.token == token && s.state() == nil {
			return true
		}
	}
	return false
}
