// Package notify keeps one reconnecting LISTEN connection and wakes
// subscribers when a NOTIFY arrives on one of its channels.
//
// A wake-up means "look again": either a matching notification arrived or the
// connection was (re)established, in which case every subscription is woken
// because notifications sent while it was down are lost. Wake-ups are
// coalesced in a buffered-1 channel and never block the connection.
//
// Reconnect policy: after a failure the listener waits a jittered delay drawn
// from [d/2, d), where d starts at 50ms and doubles up to 5s. d goes back to
// 50ms once a connection has stayed up for 5s, so a server that accepts and
// then drops connections is not hammered, while a single failover is
// recovered from within about 50ms. The jitter spreads the reconnects of many
// processes after a failover.
package notify

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

const (
	minBackoff     = 50 * time.Millisecond
	maxBackoff     = 5 * time.Second
	connectTimeout = 30 * time.Second
)

// Config describes a Listener.
type Config struct {
	// Channels are LISTENed on, one LISTEN statement each. At least one.
	Channels []string
	// KeyedChannels are those of Channels whose payloads are "key data...":
	// SubscribePayload subscriptions on them match the key (the payload up
	// to its first space) instead of the whole payload.
	KeyedChannels []string
	// Logger receives a Warn line (DownMsg) per failed or lost connection and
	// a Debug line (UpMsg) per established one. Defaults to discarding them.
	Logger *slog.Logger
	// DownMsg and UpMsg are the messages of those lines. Default to
	// "notify: LISTEN connection lost" and "notify: listening".
	DownMsg, UpMsg string
}

// Listener owns one LISTEN connection, opened outside the pool with the
// pool's connection settings so it never takes one of the pool's slots.
// It is safe for concurrent use.
type Listener struct {
	pool     *pgxpool.Pool
	channels []string
	log      *slog.Logger
	downMsg  string
	upMsg    string

	mu       sync.Mutex
	subs     map[string]*channelSubs
	started  bool
	stopped  bool
	up       bool
	connects int   // successful connections so far (tests)
	failures int   // connection attempts (and sessions) that failed so far
	lastErr  error // the error of the latest failure
	// changed is closed, and replaced, whenever the connection goes up or
	// an attempt fails: WaitUp waits on it.
	changed chan struct{}
	cancel  context.CancelFunc
	done    chan struct{}
}

type channelSubs struct {
	keyed     bool
	any       map[*Subscription]struct{}
	byPayload map[string]map[*Subscription]struct{}
}

// Subscription is a subscriber's wake-up channel; see [Listener.Subscribe].
type Subscription struct {
	l       *Listener
	channel string
	payload string
	any     bool
	ch      chan struct{}
	// last is the payload of the latest notification that woke the
	// subscription since the previous Payload call, nil if none or if a
	// (re)connection woke it after that notification (under l.mu).
	last *string
}

// New returns a stopped Listener for pool. It panics if pool is nil or
// Channels is empty or holds an empty name: those are programming errors.
func New(pool *pgxpool.Pool, cfg Config) *Listener {
	if pool == nil {
		panic("notify: nil pool")
	}
	if len(cfg.Channels) == 0 {
		panic("notify: no channel")
	}
	l := &Listener{
		pool:     pool,
		channels: append([]string(nil), cfg.Channels...),
		log:      cfg.Logger,
		downMsg:  cfg.DownMsg,
		upMsg:    cfg.UpMsg,
		subs:     make(map[string]*channelSubs, len(cfg.Channels)),
		changed:  make(chan struct{}),
	}
	for _, c := range l.channels {
		if c == "" {
			panic("notify: empty channel name")
		}
		l.subs[c] = &channelSubs{any: map[*Subscription]struct{}{}, byPayload: map[string]map[*Subscription]struct{}{}}
	}
	for _, c := range cfg.KeyedChannels {
		cs := l.subs[c]
		if cs == nil {
			panic("notify: keyed channel " + c + " is not one of Channels")
		}
		cs.keyed = true
	}
	if l.log == nil {
		l.log = slog.New(slog.DiscardHandler)
	}
	if l.downMsg == "" {
		l.downMsg = "notify: LISTEN connection lost"
	}
	if l.upMsg == "" {
		l.upMsg = "notify: listening"
	}
	return l
}

// Start opens the connection in the background and keeps it open until
// Stop. It does not wait for the connection. Calling it again, or after
// Stop, does nothing.
func (l *Listener) Start() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.started || l.stopped {
		return
	}
	l.started = true
	ctx, cancel := context.WithCancel(context.Background())
	l.cancel, l.done = cancel, make(chan struct{})
	go l.run(ctx)
}

// Stop closes the connection and waits for the background goroutine to
// end. Subscriptions are not woken. It is safe to call more than once and
// before Start; a stopped Listener cannot be started again.
func (l *Listener) Stop() {
	l.mu.Lock()
	l.stopped = true
	cancel, done := l.cancel, l.done
	l.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
}

// Up reports whether the connection is currently LISTENing.
func (l *Listener) Up() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.up
}

// WaitUp starts the connection if it is not started and waits until it is
// LISTENing (nil), a connection attempt that had not failed when WaitUp was
// called fails (its error; the Listener goes on retrying), done is closed
// (errDone) or ctx ends (ctx's error, with the latest failure's joined to it
// if there was one). A stopped Listener never comes up: WaitUp then waits
// for done or ctx.
func (l *Listener) WaitUp(ctx context.Context, done <-chan struct{}, errDone error) error {
	l.Start()
	l.mu.Lock()
	f0 := l.failures
	l.mu.Unlock()
	for {
		l.mu.Lock()
		up, failures, lastErr, changed := l.up, l.failures, l.lastErr, l.changed
		l.mu.Unlock()
		switch {
		case up:
			return nil
		case failures > f0:
			return lastErr
		}
		select {
		case <-ctx.Done():
			if lastErr != nil {
				return errors.Join(context.Cause(ctx), lastErr)
			}
			return context.Cause(ctx)
		case <-done:
			return errDone
		case <-changed:
		}
	}
}

// Subscribe returns a subscription woken by every notification on channel,
// whatever its payload, and by every (re)connection. channel must be one of
// Config.Channels.
func (l *Listener) Subscribe(channel string) *Subscription {
	return l.subscribe(channel, "", true)
}

// SubscribePayload is Subscribe limited to notifications on channel whose
// payload equals payload (on a Config.KeyedChannels channel: whose payload up
// to its first space equals payload); every (re)connection still wakes it.
// A wake-up proves nothing: any role that may connect can NOTIFY, so a
// subscriber reads what it needs from the database, or checks what
// [Subscription.Payload] returns against something the sender cannot forge.
func (l *Listener) SubscribePayload(channel, payload string) *Subscription {
	return l.subscribe(channel, payload, false)
}

func (l *Listener) subscribe(channel, payload string, anyPayload bool) *Subscription {
	s := &Subscription{l: l, channel: channel, payload: payload, any: anyPayload, ch: make(chan struct{}, 1)}
	l.mu.Lock()
	defer l.mu.Unlock()
	cs := l.subs[channel]
	if cs == nil {
		panic("notify: subscription to channel " + channel + " that the Listener does not LISTEN on")
	}
	if anyPayload {
		cs.any[s] = struct{}{}
		return s
	}
	set := cs.byPayload[payload]
	if set == nil {
		set = make(map[*Subscription]struct{})
		cs.byPayload[payload] = set
	}
	set[s] = struct{}{}
	return s
}

// C returns the wake-up channel. It has a buffer of one: wake-ups that arrive
// while one is pending are merged into it.
func (s *Subscription) C() <-chan struct{} { return s.ch }

// Close removes the subscription; it is not woken afterwards. Safe to call
// more than once.
func (s *Subscription) Close() {
	l := s.l
	l.mu.Lock()
	defer l.mu.Unlock()
	cs := l.subs[s.channel]
	if s.any {
		delete(cs.any, s)
		return
	}
	if set := cs.byPayload[s.payload]; set != nil {
		delete(set, s)
		if len(set) == 0 {
			delete(cs.byPayload, s.payload)
		}
	}
}

// Payload returns the whole payload of the latest notification that woke s
// since the previous call (ok false if none did, or if a (re)connection woke
// s after it), and forgets it. Anyone may send a notification: the payload
// is a claim, not a fact.
func (s *Subscription) Payload() (payload string, ok bool) {
	s.l.mu.Lock()
	defer s.l.mu.Unlock()
	p := s.last
	s.last = nil
	if p == nil {
		return "", false
	}
	return *p, true
}

// wake signals s; l.mu is held. payload is the notification's (nil: a
// (re)connection).
func (s *Subscription) wake(payload *string) {
	s.last = payload
	select {
	case s.ch <- struct{}{}:
	default:
	}
}

// dispatch wakes the subscriptions that match a notification.
func (l *Listener) dispatch(channel, payload string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	cs := l.subs[channel]
	if cs == nil {
		return
	}
	p := &payload
	for s := range cs.any {
		s.wake(p)
	}
	key := payload
	if cs.keyed {
		if i := strings.IndexByte(payload, ' '); i >= 0 {
			key = payload[:i]
		}
	}
	if set := cs.byPayload[key]; len(set) > 0 {
		for s := range set {
			s.wake(p)
		}
	}
}

// setUp records the connection state; going up wakes every subscription.
func (l *Listener) setUp(up bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.up = up
	if !up {
		return
	}
	l.connects++
	l.signalChange()
	for _, cs := range l.subs {
		for s := range cs.any {
			s.wake(nil)
		}
		for _, set := range cs.byPayload {
			for s := range set {
				s.wake(nil)
			}
		}
	}
}

// failed records a failed connection attempt or a lost session.
func (l *Listener) failed(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.failures++
	l.lastErr = err
	l.signalChange()
}

// signalChange wakes WaitUp calls; l.mu is held.
func (l *Listener) signalChange() {
	close(l.changed)
	l.changed = make(chan struct{})
}

// run keeps the connection open until ctx ends (see the package
// documentation for the reconnect policy).
func (l *Listener) run(ctx context.Context) {
	defer close(l.done)
	backoff := minBackoff
	channel := strings.Join(l.channels, ",")
	for ctx.Err() == nil {
		upAt, err := l.session(ctx)
		l.setUp(false)
		if ctx.Err() != nil {
			return
		}
		l.failed(err)
		if !upAt.IsZero() && time.Since(upAt) >= maxBackoff {
			backoff = minBackoff
		}
		delay := backoff/2 + rand.N(backoff/2)
		l.log.Warn(l.downMsg, "channel", channel, "retry_in", delay, "err", err)
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(backoff*2, maxBackoff)
	}
}

// session connects, LISTENs, wakes every subscription and then dispatches
// notifications until the connection fails or ctx ends. upAt is when the
// LISTENs succeeded, zero if they did not.
func (l *Listener) session(ctx context.Context) (upAt time.Time, err error) {
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	conn, err := pgx.ConnectConfig(cctx, l.pool.Config().ConnConfig.Copy())
	cancel()
	if err != nil {
		return time.Time{}, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = conn.Close(cctx)
		cancel()
	}()
	for _, c := range l.channels {
		if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{c}.Sanitize()); err != nil {
			return time.Time{}, err
		}
	}
	upAt = time.Now()
	l.setUp(true)
	l.log.Debug(l.upMsg, "channel", strings.Join(l.channels, ","))
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return upAt, err
		}
		l.dispatch(n.Channel, n.Payload)
	}
}
