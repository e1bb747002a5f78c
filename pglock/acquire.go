package pglock

import (
	"context"
	"errors"
	"log/slog"
	mrand "math/rand/v2"
	"slices"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/pgerr"
)

// TryAcquire makes one attempt to take the lock name for ttl. It returns the
// lease, or a [*pgfence.Error] matching [pgfence.ErrLocked], with the holder
// and its expiry, when the lock is held, including by this same Locker. If
// ctx is cancelled the grant may or may not have committed; if it did, the
// lock stays held by this Locker's holder until ttl passes (unless the
// grant was batched with other calls': a batch's grant whose caller gave up
// is given back). A grant answered
// after ttl is given back (also when ctx ended as the answer came) and
// reported as a [*pgfence.Error] matching [pgfence.ErrSlowGrant] (with the
// token; its Reason says whether giving it back failed, leaving it held
// until it expires; [pgfence.IsRetryable] is true).
func (l *Locker) TryAcquire(ctx context.Context, name string, ttl time.Duration) (*Lease, error) {
	const op = "pglock.TryAcquire"
	if err := validateName(op, name); err != nil {
		return nil, err
	}
	if err := validateTTL(op, ttl); err != nil {
		return nil, err
	}
	if l.isClosed() || !l.calls.enter() {
		return nil, closedError(op, name)
	}
	defer l.calls.done()
	start := time.Now()
	lease, locked, _, err := l.grant(ctx, op, name, ttl, attemptTry, nil)
	if err == nil && locked != nil {
		err = locked
	}
	lease, err = l.giveBackIfClosed(ctx, op, lease, err)
	l.recordAcquire(ctx, name, start, false, lease, err)
	if err != nil {
		return nil, err
	}
	return lease, nil
}

// recordAcquire reports one TryAcquire/Acquire call to the metrics and log.
func (l *Locker) recordAcquire(ctx context.Context, name string, start time.Time, waited bool, lease *Lease, err error) {
	elapsed := time.Since(start).Seconds()
	switch {
	case err == nil:
		l.m.Observe(ctx, metricdefs.LeaseAcquireSeconds, elapsed, metricdefs.OutcomeGranted)
		if waited {
			l.m.Observe(ctx, metricdefs.LeaseWaitSeconds, elapsed)
		}
		if l.log.Enabled(context.Background(), slog.LevelInfo) { // no argument boxing on the hot path when silent
			l.log.Info("pglock: granted", "name", name, "token", lease.token, "ttl", lease.ttl, "expires_at", lease.ExpiresAt())
		}
	case errors.Is(err, pgfence.ErrLocked):
		l.m.Observe(ctx, metricdefs.LeaseAcquireSeconds, elapsed, metricdefs.OutcomeLocked)
	default:
		l.m.Observe(ctx, metricdefs.LeaseAcquireSeconds, elapsed, metricdefs.OutcomeError)
	}
}

// Acquire takes the lock name for ttl, waiting while someone else holds it,
// until it gets the lease or ctx ends. It sleeps until a release or the
// holder's expiry (see the package documentation, "Waiting").
//
// When ctx ends while waiting, the error is a [*pgfence.Error] matching
// [pgfence.ErrLocked], with the last holder seen, whose cause (Err) is ctx's
// error (errors.Is(err, context.DeadlineExceeded)); when it ends during a
// round trip, a [*pgfence.Error] with no Kind that matches it too. Database
// errors end the wait and are returned as a [*pgfence.Error] whose cause is
// the driver's error, and a grant that arrived too late to be used matches
// [pgfence.ErrSlowGrant] (see [Locker.TryAcquire]): also a lease a release
// handed to the wait, when the queueing statement that returned it answered
// after what was left of it when the statement was sent (its local
// deadline); it is given back too.
func (l *Locker) Acquire(ctx context.Context, name string, ttl time.Duration) (*Lease, error) {
	const op = "pglock.Acquire"
	if err := validateName(op, name); err != nil {
		return nil, err
	}
	if err := validateTTL(op, ttl); err != nil {
		return nil, err
	}
	start := time.Now()
	lease, waited, err := l.acquireWaited(ctx, op, name, ttl, waitOpts{})
	l.recordAcquire(ctx, name, start, waited, lease, err)
	return lease, err
}

// acquireWaited is acquire, also reporting whether it had to wait.
func (l *Locker) acquireWaited(ctx context.Context, op, name string, ttl time.Duration, o waitOpts) (*Lease, bool, error) {
	waited := false
	o.onWait = func() { waited = true }
	lease, err := l.acquire(ctx, op, name, ttl, o)
	return lease, waited, err
}

// giveBackIfClosed returns lease and err, unless lease was granted after
// the Locker closed (Close had ended it before it could be registered):
// nobody could use it, so it is released in the database, and the call
// gets an error matching pgfence.ErrClosed instead of an ended lease.
func (l *Locker) giveBackIfClosed(ctx context.Context, op string, lease *Lease, err error) (*Lease, error) {
	if lease == nil || !lease.bornClosed {
		return lease, err
	}
	l.giveBack(ctx, op, lease.name, lease.token, "pglock: release of a lease granted after Close")
	return nil, closedError(op, lease.name)
}

// waitOpts adjust acquire for the election campaign.
type waitOpts struct {
	cap      time.Duration // longest single sleep; 0 = Config.PollInterval
	retryErr time.Duration // > 0: retry database errors after this long instead of returning them
	onErr    func(error)
	onWait   func() // called before each sleep
	// finish, when set, lets each grant statement (and read of a handed
	// lease) answer when ctx ends while it is out, bounded by the TTL: a
	// grant is then returned, never lost, and the caller gives it back.
	finish bool
}

// statementCtx is the context of one grant statement: ctx, or with
// o.finish, ctx without its cancellation, bounded by ttl (a later answer is
// of no use: grant gives it back).
func (o *waitOpts) statementCtx(ctx context.Context, ttl time.Duration) (context.Context, context.CancelFunc) {
	if !o.finish {
		return ctx, func() {}
	}
	return context.WithTimeout(context.WithoutCancel(ctx), ttl)
}

// op is the exported call, for errors: a separate argument, not a field of
// o, so that o (whose onWait closure the caller keeps on its stack) does not
// escape with it (escape analysis does not tell a struct's fields apart).
func (l *Locker) acquire(ctx context.Context, op, name string, ttl time.Duration, o waitOpts) (*Lease, error) {
	if !l.calls.enter() {
		return nil, closedError(op, name)
	}
	defer l.calls.done()
	lease, err := l.acquireTurns(ctx, op, name, ttl, o)
	return l.giveBackIfClosed(ctx, op, lease, err)
}

// acquireTurns is acquire's loop of attempts and waits.
func (l *Locker) acquireTurns(ctx context.Context, op, name string, ttl time.Duration, o waitOpts) (*Lease, error) {
	var w *waiter
	queued, got := false, false // QueueGrant ran (the waiter may be in the queue); a lease is returned
	defer func() {
		if w == nil {
			return
		}
		l.lis.unregister(w)
		if w.detached {
			return // its QueueGrant's goroutine leaves the queue (queueGrant)
		}
		// The row of w.wkey may serve this Locker's next wait of name
		// (updated in place) once this wait is over in the database: it was
		// handed the lease or granted it (QueueGrant ended it), or it left
		// the queue. After a failure its state is unknown: the key is
		// dropped and the row is deleted once its alive_until passes.
		reuse := !queued || got
		if queued && !got {
			reuse = l.leaveQueue(name, w.wkey, w.waitID, 0)
		}
		if reuse {
			l.putSlot(name, w.wkey)
		}
	}()
	var timer, backoff *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
		if backoff != nil {
			backoff.Stop()
		}
	}()
	woken, losses, waits := false, 0, 0 // the last sleep ended with a wake-up; wake-ups lost in a row; sleeps
	retakes := 0                        // new wkeys taken because another key queued under one (PF013)
	// queuedAt is taken before the first QueueGrant of this waiter is sent:
	// a release that hands it a lease sees its queue row, so it measures
	// what is left of the lease (a tagged payload's left_us) after
	// queuedAt. The lease ends no earlier than queuedAt + left_us; not
	// queuedAt + ttl, since its expiry counts from the start of the
	// releasing transaction, which may come before queuedAt (handoff.go).
	var queuedAt time.Time
	if l.lis != nil && l.isHot(name) {
		// Waited for last time: queue at once (QueueGrant grants a free lock
		// too), skipping the GrantLock that would most likely be refused.
		w = l.lis.register(name)
	}
	for {
		if l.isClosed() {
			return nil, closedError(op, name)
		}
		kind := attemptTry
		switch {
		case w != nil:
			kind = attemptWait
		case l.lis != nil:
			kind = attemptFirst // if refused, register and retry as a waiter at once
		}
		if w != nil {
			queued = true
			if queuedAt.IsZero() {
				queuedAt = time.Now()
			}
		}
		sctx, cancel := o.statementCtx(ctx, ttl)
		lease, locked, wait, err := l.grant(sctx, op, name, ttl, kind, w)
		cancel()
		if w != nil && retakes < maxRetakes && pgerr.Code(err) == pgerr.WaitKeyTaken {
			// Another key queued under this wait's wkey (wkeys are in
			// every handoff payload): nothing changed; wait under a new
			// random one, and never use this one again.
			retakes++
			l.lis.unregister(w)
			w, queuedAt = l.lis.registerFresh(name), time.Time{}
			continue
		}
		if err != nil && (o.retryErr <= 0 || ctx.Err() != nil || errors.Is(err, pgfence.ErrClosed)) {
			return nil, err
		}
		if w != nil && w.detached {
			// Its statement outlived the statement's context (o.finish: the
			// TTL), and its goroutine ends that wait: wait on under a new
			// key after the error's pause.
			l.lis.unregister(w)
			w, queuedAt = l.lis.registerFresh(name), time.Time{}
		}
		if lease != nil {
			got = true
			l.setHot(name, w != nil && waits > 0)
			return lease, nil
		}
		if err != nil {
			if o.onErr != nil {
				o.onErr(err)
			}
			locked, wait = &pgfence.Error{Op: op, Kind: pgfence.ErrLocked, Name: name}, o.retryErr
		} else if w == nil && l.lis != nil {
			// Register before the next attempt: a release that commits after
			// that attempt is then seen by the listener (or, if the listener
			// is not up yet, its (re)connection wakes every waiter).
			w = l.lis.register(name)
			continue
		}
		if p := l.cfg.PollInterval; p > 0 && p < wait {
			wait = p
		}
		if o.cap > 0 && o.cap < wait {
			wait = o.cap
		}
		if w != nil && ttl/2 < wait {
			// A queued waiter pushes its alive_until (now() + ttl) forward
			// with each attempt: a release skips it once that has passed.
			wait = ttl / 2
		}
		waits++
		if l.waitHook != nil {
			l.waitHook(name)
		}
		if o.onWait != nil {
			o.onWait()
		}
		if timer == nil {
			timer = time.NewTimer(wait)
		} else {
			timer.Reset(wait)
		}
		var wake, handoff <-chan struct{}
		if w != nil {
			wake, handoff = w.ch, w.hch
		}
		var backoffC <-chan time.Time
		if woken {
			// Woken by a release and beaten to the grant: the lock is hot.
			// Back off before answering the next wake-up, so that N waiters
			// of one hot lock do not each run a statement on every release.
			losses++
			if backoff == nil {
				backoff = time.NewTimer(hotBackoff(losses))
			} else {
				backoff.Reset(hotBackoff(losses))
			}
			backoffC = backoff.C
		}
		var end turnEnd
		end, woken = waitTurn(ctx, l.closedCh, wake, handoff, timer.C, backoffC)
		timer.Stop()
		if backoff != nil {
			backoff.Stop()
		}
		switch end {
		case turnCtxDone:
			locked.Err = context.Cause(ctx)
			return nil, locked
		case turnClosed:
			return nil, closedError(op, name)
		case turnHandoff:
			// A notification says a release handed the lease to this wait.
			// Any role that can read pgfence.lock_queue can send one with
			// this wait's key and id: only a payload whose tag checks with
			// this Locker's handoff key is taken as the lease (handoff.go).
			// Otherwise the lease is the one the database shows granted to
			// this wait (HandedLock, a read, no commit); if it is not there
			// (or already ended), the next attempt looks again.
			if lease := l.taggedHandoff(ctx, name, ttl, w, queuedAt); lease != nil {
				got = true
				l.setHot(name, true)
				return lease, nil
			}
			sctx, cancel := o.statementCtx(ctx, ttl)
			lease, err := l.handed(sctx, op, name, ttl, w.wkey, w.waitID)
			cancel()
			if err != nil && (o.retryErr <= 0 || ctx.Err() != nil) {
				return nil, err
			}
			if lease != nil {
				got = true
				l.setHot(name, true)
				return lease, nil
			}
		}
	}
}

// maxRetakes bounds the new queue keys one Acquire takes when its wkey is
// queued under another key (PF013): a fresh random key cannot have been
// seen by anyone, so one is enough unless something else is wrong, and then
// the error is returned.
const maxRetakes = 3

// maxHot bounds the names a Locker remembers as hot.
const maxHot = 4096

// isHot reports whether the last Acquire of name through this Locker had to
// wait. Without hot names (the uncontended case) it takes no lock.
func (l *Locker) isHot(name string) bool {
	if l.nHot.Load() == 0 {
		return false
	}
	l.hotMu.Lock()
	_, ok := l.hot[name]
	l.hotMu.Unlock()
	return ok
}

// setHot records whether an Acquire of name had to wait.
func (l *Locker) setHot(name string, hot bool) {
	if !hot && l.nHot.Load() == 0 {
		return
	}
	l.hotMu.Lock()
	defer l.hotMu.Unlock()
	defer func() { l.nHot.Store(int64(len(l.hot))) }()
	if !hot {
		delete(l.hot, name)
		return
	}
	if l.hot == nil || len(l.hot) >= maxHot {
		if _, ok := l.hot[name]; ok {
			return
		}
		l.hot = make(map[string]struct{})
	}
	l.hot[name] = struct{}{}
}

// Bounds of the queue keys a Locker keeps for reuse (see takeSlot): names,
// and keys per name (as many as its concurrent waits of the name).
const (
	maxSlotNames   = maxHot
	maxSlotsByName = 64
)

// takeSlot returns a queue key of name whose wait is over, to reuse its row
// in pgfence.lock_queue, or 0 (none: register picks a new random key). A
// reused row is updated in place (a HOT update, no new index entry), where a
// new key inserts a row that is deleted later, leaving a dead index entry
// behind for VACUUM; on a hot name that is one per grant.
func (l *Locker) takeSlot(name string) int64 {
	l.hotMu.Lock()
	defer l.hotMu.Unlock()
	keys := l.slots[name]
	if len(keys) == 0 {
		return 0
	}
	k := keys[len(keys)-1]
	if len(keys) == 1 {
		delete(l.slots, name)
	} else {
		l.slots[name] = keys[:len(keys)-1]
	}
	return k
}

// putSlot keeps wkey, whose wait of name is over in the database, for the
// next wait of name (takeSlot).
func (l *Locker) putSlot(name string, wkey int64) {
	l.hotMu.Lock()
	defer l.hotMu.Unlock()
	keys, ok := l.slots[name]
	switch {
	case !ok && len(l.slots) >= maxSlotNames:
		return // the rows of keys not kept are deleted once dead
	case len(keys) >= maxSlotsByName:
		return
	case l.slots == nil:
		l.slots = make(map[string][]int64)
	}
	l.slots[name] = append(keys, wkey)
}

// turnEnd says why waitTurn returned.
type turnEnd uint8

const (
	turnNext    turnEnd = iota // try again: a wake-up, or the timer fired
	turnHandoff                // a release handed the lease to this waiter: read it
	turnCtxDone                // ctx ended
	turnClosed                 // the Locker was closed
)

// waitTurn is a waiter's sleep between two attempts. It ends when ctx ends,
// the Locker closes, timerC fires (try at once, backoff or not), or a wake-up
// arrives on wake. While backoffC has not fired, wake-ups stay in the
// buffered channel (none is lost). woken reports whether a wake-up ended it.
func waitTurn(ctx context.Context, closed <-chan struct{}, wake, handoff <-chan struct{}, timerC, backoffC <-chan time.Time) (end turnEnd, woken bool) {
	for {
		w := wake
		if backoffC != nil {
			w = nil
		}
		select {
		case <-ctx.Done():
			return turnCtxDone, false
		case <-closed:
			return turnClosed, false
		case <-handoff:
			return turnHandoff, false
		case <-timerC:
			return turnNext, false
		case <-backoffC:
			backoffC = nil // now answer wake-ups
		case <-w:
			return turnNext, true
		}
	}
}

// hotBackoff is how long a waiter that lost the race after its n-th
// consecutive wake-up waits before it answers the next one: 0.5 ms doubling
// up to maxHotBackoff, with up to 50% jitter.
func hotBackoff(n int) time.Duration {
	d := min(maxHotBackoff, (time.Millisecond/2)<<min(n-1, 10))
	return d/2 + mrand.N(d/2+1)
}

// maxHotBackoff caps hotBackoff, far below a polling interval.
const maxHotBackoff = 16 * time.Millisecond

// maxWait bounds a single sleep of a waiter, so a lost notification costs at
// most this long. The wait-mark windows of QueueGrant (30 s) and ReleaseLock
// (100 s) assume it: do not raise it alone (docs/design.md, "The wait mark").
const maxWait = time.Minute

// attemptKind selects the statements of one grant attempt.
type attemptKind uint8

const (
	// attemptTry: GrantLock, and when refused LockHolder for the holder and
	// its expiry (TryAcquire; Acquire without a listener).
	attemptTry attemptKind = iota
	// attemptFirst: GrantLock alone; when refused the caller registers as a
	// waiter and goes on with attemptWait, which reads the holder anyway.
	attemptFirst
	// attemptWait: QueueGrant, grant, handed lease, or queue-mark-and-read in
	// one statement.
	attemptWait
)

// AcquireMany acquires every name with [Locker.Acquire] in one canonical
// order (sorted by bytes), so callers asking for overlapping sets cannot
// deadlock. It is all or nothing: if one acquisition fails, the leases already
// taken are released and the error is returned; if a lease taken first has
// ended by the time the last is granted (its deadline passed while a later
// name was waited for: give the leases a TTL longer than the wait, or use
// Config.KeepAlive), all are released and the error matches
// [pgfence.ErrLost]. Leases come back in the order
// of names. Invalid or duplicate names give a [*pgfence.Error] matching
// [pgfence.ErrInvalid] before any SQL.
func (l *Locker) AcquireMany(ctx context.Context, names []string, ttl time.Duration) ([]*Lease, error) {
	const op = "pglock.AcquireMany"
	if len(names) == 0 {
		return nil, invalid(op, "lock names", "no names")
	}
	if err := validateTTL(op, ttl); err != nil {
		return nil, err
	}
	order := make([]int, len(names))
	for i, n := range names {
		if err := validateName(op, n); err != nil {
			return nil, err
		}
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		switch {
		case names[a] < names[b]:
			return -1
		case names[a] > names[b]:
			return 1
		}
		return 0
	})
	for i := 1; i < len(order); i++ {
		if names[order[i]] == names[order[i-1]] {
			return nil, invalid(op, "lock names", "duplicate name %q", names[order[i]])
		}
	}
	// Counted for Close as a whole: the leases taken are given back
	// (releaseAll) before Close returns.
	if !l.calls.enter() {
		return nil, closedError(op, names[order[0]])
	}
	defer l.calls.done()
	leases := make([]*Lease, len(names))
	for _, i := range order {
		s, err := l.acquire(ctx, op, names[i], ttl, waitOpts{})
		if err != nil {
			l.releaseAll(leases)
			return nil, err
		}
		leases[i] = s
	}
	// All or nothing: a lease taken first may have ended while a later name
	// was waited for (its local deadline passed, without KeepAlive; the
	// Locker closed), and another holder may hold it already.
	for _, s := range leases {
		err := s.Err()
		if err == nil && !time.Now().Before(s.Deadline()) {
			err = errDeadline
		}
		if err == nil {
			continue
		}
		l.releaseAll(leases)
		if errors.Is(err, pgfence.ErrClosed) {
			return nil, closedError(op, s.name)
		}
		return nil, s.lost(op, err)
	}
	return leases, nil
}

// releaseAll releases the non-nil leases, best effort, with its own timeout
// (the caller's context may already be over).
func (l *Locker) releaseAll(leases []*Lease) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, s := range leases {
		if s != nil {
			if err := s.Release(ctx); err != nil {
				l.log.Warn("pglock: release after failed AcquireMany", "name", s.name, "token", s.token, "err", err)
			}
		}
	}
}
