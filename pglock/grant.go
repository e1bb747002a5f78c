package pglock

import (
	"context"
	"errors"
	mrand "math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/pgerr"
)

// grant makes one attempt (statements chosen by kind, see attemptKind). It
// returns either a lease, or an error of kind pgfence.ErrLocked with how long
// to wait for the holder's expiry (database clock, plus jitter). op is the
// exported call, for errors; w is the waiter of an attemptWait (nil
// otherwise).
func (l *Locker) grant(ctx context.Context, op, name string, ttl time.Duration, kind attemptKind, w *waiter) (*Lease, *pgfence.Error, time.Duration, error) {
	mark := kind == attemptWait
	for attempt := 0; ; {
		var (
			sent      time.Time
			granted   bool
			changed   bool // the lock changed under the call: call again
			token     int64
			expiresAt *time.Time
			holder    *string
			dbNow     time.Time
			err       error
		)
		if mark {
			var r dbsqlc.QueueGrantRow
			r, sent, err = l.queueGrant(ctx, op, name, ttl, w)
			granted, changed = r.Granted.Valid && r.Granted.Bool, !r.Granted.Valid
			token, expiresAt, holder = r.Token.Int64, r.ExpiresAt, r.HeldBy
			if r.DbNow != nil {
				dbNow = *r.DbNow
			}
		} else {
			// Coalesced with the other non-waiting grants of this Locker
			// (coalesce.go); sent is its statement's send time.
			var r grantRes
			r, sent, err = l.grants.do(ctx, grantReq{name: name, ttlUs: ttl.Microseconds()})
			if err == nil && r.Exhausted {
				err = errExhausted
			}
			granted, token, dbNow = r.Token > 0, r.Token, r.DbNow
			if r.HasExpiry {
				expiresAt = &r.ExpiresAt
			}
			if r.HasHolder {
				holder = &r.HeldBy
			}
			changed = !granted && !r.HasHolder
		}
		if errors.Is(err, errCoalescerClosed) {
			return nil, nil, 0, closedError(op, name)
		}
		if err != nil {
			return nil, nil, 0, translateGrantError(op, name, err)
		}
		if granted {
			if expiresAt == nil {
				return nil, nil, 0, dbError(op, name, errors.New("grant returned no expiry"))
			}
			// The lease's local deadline is sent + left: its TTL, or, for a
			// lease a release handed to this wait before the statement ran
			// (QueueGrant returns it with less than the TTL left), what the
			// database says is left, counted from the send time (never
			// later than the lease's end). Every path refuses a lease whose
			// local deadline has passed when its answer is read: here, and
			// in handed (whose wait's next QueueGrant then reads the lease
			// again, and lands here). No more is asked: a tagged handoff
			// (taggedHandoff) wants half the TTL left because it counts from
			// when the wait queued and a read counts from later, but this
			// deadline counts from this statement already, and a later one
			// would only find less left.
			left := ttl
			if mark && expiresAt.Sub(dbNow) < ttl {
				left = expiresAt.Sub(dbNow)
			}
			if took := time.Since(sent); took >= left {
				// The answer came back after the lease's local deadline: the
				// lease would end the moment it was returned. Give the
				// token back (conditional on it, on a context that outlives
				// ctx: the caller's may have ended as the answer came; a
				// handed lease then goes to the next waiter) and report.
				then := "it was released"
				if !l.giveBack(ctx, op, name, token, "pglock: release of a grant answered after its local deadline failed; it stays held until it expires") {
					then = "releasing it failed, so it stays held until it expires"
				}
				return nil, nil, 0, slowLeaseError(op, name, token, took, left, ttl, then)
			}
			return l.newLease(name, token, ttl, *expiresAt, sent.Add(left-ttl)), nil, 0, nil
		}
		if kind == attemptFirst {
			return nil, &pgfence.Error{Op: op, Kind: pgfence.ErrLocked, Name: name}, 0, nil
		}
		if !changed && holder != nil && expiresAt != nil {
			return nil, &pgfence.Error{Op: op, Kind: pgfence.ErrLocked, Name: name, Holder: *holder, ExpiresAt: *expiresAt},
				jitterWait(expiresAt.Sub(dbNow)), nil
		}
		// Released or expired during the call, or a concurrent first grant:
		// try again.
		if attempt++; attempt > 3 {
			return nil, &pgfence.Error{Op: op, Kind: pgfence.ErrLocked, Name: name}, jitterWait(0), nil
		}
	}
}

// queueGrant sends the waiter w's QueueGrant: a statement that can grant, so
// it is not cancelled once sent (detach.go). When ctx ends first, or the
// Locker closes, it returns ctx's error (errCoalescerClosed) at once and
// marks w detached; once the statement has
// answered, finishDetached gives back a lease it got and takes the wait out
// of the queue (before, the wait left the queue at once, and a statement
// delayed on the network queued it again afterwards, or granted it a lease,
// held by nobody until its TTL). sent is when the statement was written to
// the connection: a lease's local deadline counts from it.
func (l *Locker) queueGrant(ctx context.Context, op, name string, ttl time.Duration, w *waiter) (dbsqlc.QueueGrantRow, time.Time, error) {
	if err := ctx.Err(); err != nil {
		return dbsqlc.QueueGrantRow{}, time.Time{}, err
	}
	stmt := func(ctx context.Context, conn *pgxpool.Conn, p *pending) (err error) {
		if !p.sending() {
			return errDetached
		}
		p.res, err = l.q.QueueGrant(ctx, conn, dbsqlc.QueueGrantParams{
			Name: name, Holder: l.holder, TtlUs: ttl.Microseconds(), Key: l.key, Wkey: w.wkey, WaitID: w.waitID,
		})
		return err
	}
	// Also when ctx never ends (context.Background()): the caller must
	// still return at Close, and Close end the statement after its wait,
	// so that the pool can be closed (a statement run on the caller's
	// goroutine did neither). It costs such a caller what every caller
	// whose context can end pays (a goroutine, and pgx watching the
	// statement's context): the waiter's statement, not a lone grant's.
	r, sent, err, detached := sendDetachable(l, ctx, ttl, stmt,
		func(p *pending) { l.finishDetached(op, name, w, p) })
	w.detached = detached
	return r, sent, err
}

// finishDetached ends the wait of a caller that gave up while its QueueGrant
// was out (queueGrant), once the statement has answered: it gives back a
// lease the statement granted or was handed, and takes the wait out of the
// queue (which gives back a lease a release handed to it since, unless it
// is the one given back already).
func (l *Locker) finishDetached(op, name string, w *waiter, p *pending) {
	var given int64
	if t := p.res.Token.Int64; p.err == nil && p.res.Granted.Valid && p.res.Granted.Bool && t > 0 &&
		l.giveBack(context.Background(), op, name, t, "pglock: release of a lease granted after its waiter gave up") {
		// Leaving the queue need not release it again. (After a failed
		// give-back it does, when a release handed the lease to the wait.)
		given = t
	}
	// A wkey another key queued under (PF013) is not used again.
	if l.leaveQueue(name, w.wkey, w.waitID, given) && pgerr.Code(p.err) != pgerr.WaitKeyTaken {
		l.putSlot(name, w.wkey)
	}
	if l.detachedHook != nil {
		l.detachedHook(name)
	}
}

// handed reads the lease a release handed to the wait (wkey, waitID)
// (HandedLock, a read). It returns nil, nil when nothing was handed or it
// already expired. The local deadline counts what the database says is left
// from the send time, which is never later than the lease's true end.
func (l *Locker) handed(ctx context.Context, op, name string, ttl time.Duration, wkey, waitID int64) (*Lease, error) {
	var (
		r    dbsqlc.HandedLockRow
		sent time.Time
	)
	l.handedReads.Add(1)
	err := l.onLiveConn(ctx, func(conn *pgxpool.Conn) (err error) {
		sent = time.Now()
		r, err = l.q.HandedLock(ctx, conn, dbsqlc.HandedLockParams{Wkey: wkey, WaitID: waitID, Key: l.key})
		return err
	})
	switch {
	case err != nil:
		return nil, dbError(op, name, err)
	case !r.Token.Valid:
		return nil, nil
	case r.ExpiresAt == nil || r.DbNow == nil:
		return nil, dbError(op, name, errors.New("handed lease has no expiry"))
	}
	left := r.ExpiresAt.Sub(*r.DbNow)
	if left <= time.Since(sent) {
		return nil, nil // it ends before it could be used: the expiry frees it
	}
	return l.newLease(name, r.Token.Int64, ttl, *r.ExpiresAt, sent.Add(left-ttl)), nil
}

// leaveQueue takes the waiter wkey out of the queue of name, and releases a
// lease a release handed to its wait (waitID) meanwhile, which hands it on
// to the next waiter, unless its token is given (a lease the caller has
// given back already) or the lease is adopted (claim). The database answers
// only a handed lease that is still live (migration 00032; before, also
// one that had expired, whose release then found it lost). Best effort, with
// its own timeout: the caller's context may be over. ok reports that the
// wait is over in the database (its row is gone, or, since migration 00032,
// the row holds an earlier wait of wkey that had ended: a Locker never has
// two waits of one key), so the key may serve another wait.
func (l *Locker) leaveQueue(name string, wkey, waitID, given int64) (ok bool) {
	ctx, cancel := context.WithTimeout(context.Background(), leaveTimeout)
	defer cancel()
	var r dbsqlc.LeaveQueueRow
	err := l.onLiveConn(ctx, func(conn *pgxpool.Conn) (err error) {
		r, err = l.q.LeaveQueue(ctx, conn, dbsqlc.LeaveQueueParams{Wkey: wkey, WaitID: waitID, Key: l.key})
		return err
	})
	token := r.GrantedToken.Int64
	switch {
	case err == nil && !r.Removed.Bool:
		return true // never queued, or already cleaned up
	case err != nil:
		// The row stays until its alive_until passes: a release may hand the
		// lease to it until then, and the lease then ends at its expiry.
		l.log.Warn("pglock: leaving the wait queue failed; a lease handed to this waiter ends at its expiry", "name", name, "err", err)
		return false
	case token == 0 || token == given:
		return true
	case l.claim(claimGiveBack, name, token) != 0:
		return true // adopted (Adopt), or being given back
	}
	defer l.unclaim(name, token)
	if err := l.release(ctx, "pglock.Acquire", name, token); err != nil && !errors.Is(err, pgfence.ErrLost) {
		l.log.Warn("pglock: giving back a lease handed to a waiter that left failed; it ends at its expiry", "name", name, "token", token, "err", err)
	}
	return true
}

// leaveTimeout bounds leaveQueue.
const leaveTimeout = 10 * time.Second

// maxDeadConns bounds how many dead pooled connections one grant skips: a
// pool emptied by a failover or a mass pg_terminate_backend is drained one
// connection per retry.
const maxDeadConns = 3

// deadConnection reports whether a statement failed because its pooled
// connection was already dead and the statement was not executed: the
// connection is closed and nothing was sent, or the answer was the server's
// termination notice (57P01/57P02/57P03). Resending is then safe; the one
// commit-before-notice window is refused as held by this holder, never a
// second holder (docs/design.md, "Dead pooled connections").
func deadConnection(conn *pgxpool.Conn, err error) bool {
	return pgerr.NotExecuted(conn.Conn().IsClosed(), err)
}

func translateGrantError(op, name string, err error) error {
	if pgerr.Code(err) == pgerr.NumericValueOutOfRange { // token + 1
		return &pgfence.Error{Op: op, Kind: pgfence.ErrTokenExhausted, Name: name,
			Reason: "the lock already has token 9223372036854775807; nothing changed"}
	}
	return dbError(op, name, err)
}

// jitterWait turns the remaining time of the holder's lease into a sleep:
// the remainder plus 1ms plus up to 5% (at most 50ms) of jitter, so that
// waiters on a crashed holder do not all retry in the same millisecond.
func jitterWait(remaining time.Duration) time.Duration {
	if remaining < 0 {
		remaining = 0
	}
	if remaining > maxWait {
		return maxWait
	}
	spread := min(remaining/20, 50*time.Millisecond) + time.Millisecond
	return remaining + time.Millisecond + mrand.N(spread)
}
