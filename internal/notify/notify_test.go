package notify

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const waitLimit = 20 * time.Second // a generous bound for a busy machine; no test waits this long when it passes

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// recv waits for a wake-up on s.
func recv(t *testing.T, s *Subscription, what string) {
	t.Helper()
	select {
	case <-s.C():
	case <-time.After(waitLimit):
		t.Fatalf("no wake-up: %s", what)
	}
}

// quiet fails if s has a pending wake-up.
func quiet(t *testing.T, s *Subscription, what string) {
	t.Helper()
	select {
	case <-s.C():
		t.Fatalf("unexpected wake-up: %s", what)
	default:
	}
}

// payloadIs checks what s.Payload returns.
func payloadIs(t *testing.T, s *Subscription, want string, wantOK bool, what string) {
	t.Helper()
	if got, ok := s.Payload(); got != want || ok != wantOK {
		t.Fatalf("%s: Payload() = %q, %v; want %q, %v", what, got, ok, want, wantOK)
	}
}

func send(t *testing.T, pool *pgxpool.Pool, channel, payload string) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), "SELECT pg_notify($1, $2)", channel, payload); err != nil {
		t.Fatal(err)
	}
}

func (l *Listener) connectCount() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.connects
}

// Notifications reach the subscriptions of their channel: all of the
// channel's Subscribe ones, and the SubscribePayload ones of that payload.
// The marker subscription proves that earlier notifications were dispatched:
// notifications are dispatched one at a time in commit order.
func TestDeliveryByChannelAndPayload(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	l := New(pool, Config{Channels: []string{"alpha", "beta"}})
	defer l.Stop()
	anyA := l.Subscribe("alpha")
	p1 := l.SubscribePayload("alpha", "p1")
	p1b := l.SubscribePayload("alpha", "p1")
	p2 := l.SubscribePayload("alpha", "p2")
	anyB := l.Subscribe("beta")
	marker := l.SubscribePayload("beta", "marker")
	all := []*Subscription{anyA, p1, p1b, p2, anyB, marker}
	if l.Up() {
		t.Fatal("Up before Start")
	}
	l.Start()
	for _, s := range all {
		recv(t, s, "the first connection wakes every subscription")
	}
	if !l.Up() {
		t.Fatal("not Up after the connection woke the subscriptions")
	}
	flush := func() {
		t.Helper()
		send(t, pool, "beta", "marker")
		recv(t, marker, "marker")
		select { // anyB also saw the marker
		case <-anyB.C():
		default:
			t.Fatal("Subscribe(beta) missed the marker")
		}
	}

	send(t, pool, "alpha", "p1")
	flush()
	recv(t, anyA, "any payload on alpha")
	recv(t, p1, "payload p1")
	recv(t, p1b, "second subscription of payload p1")
	quiet(t, p2, "p2 woken by p1")

	send(t, pool, "alpha", "other")
	flush()
	recv(t, anyA, "any payload on alpha")
	quiet(t, p1, "p1 woken by another payload")
	quiet(t, p2, "p2 woken by another payload")

	send(t, pool, "gamma", "p1") // not LISTENed on
	send(t, pool, "beta", "p1")  // other channel, same payload
	flush()
	quiet(t, anyA, "alpha woken by beta")
	quiet(t, p1, "alpha/p1 woken by beta/p1")

	// A closed subscription is not woken; its sibling still is.
	p1.Close()
	p1.Close()
	send(t, pool, "alpha", "p1")
	flush()
	recv(t, p1b, "remaining subscription of p1")
	quiet(t, p1, "closed subscription")
	recv(t, anyA, "any payload on alpha")
}

// On a keyed channel a SubscribePayload subscription matches the payload's
// key (up to its first space); on other
// channels the whole payload must match, spaces included.
func TestKeyedChannel(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	l := New(pool, Config{Channels: []string{"keyed", "plain"}, KeyedChannels: []string{"keyed"}})
	defer l.Stop()
	k1 := l.SubscribePayload("keyed", "k1")
	k12 := l.SubscribePayload("keyed", "k12")
	plain := l.SubscribePayload("plain", "my lock")
	plainMy := l.SubscribePayload("plain", "my")
	l.Start()
	for _, s := range []*Subscription{k1, k12, plain, plainMy} {
		recv(t, s, "the first connection wakes every subscription")
		payloadIs(t, s, "", false, "after a connection")
	}
	send(t, pool, "keyed", "k1 7 123")
	recv(t, k1, "key k1")
	payloadIs(t, k1, "k1 7 123", true, "key k1")
	payloadIs(t, k1, "", false, "a second Payload call")
	send(t, pool, "keyed", "k1")
	recv(t, k1, "bare key k1")
	payloadIs(t, k1, "k1", true, "bare key k1")
	quiet(t, k12, "k12 woken by k1 (keys match whole)")
	send(t, pool, "plain", "my lock")
	recv(t, plain, "whole payload on a plain channel")
	quiet(t, plainMy, "plain channel matched by prefix")
}

func TestKeyedChannelNotListenedPanics(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("no panic for a keyed channel that is not one of Channels")
		}
	}()
	New(pgtest.Pool(t), Config{Channels: []string{"a"}, KeyedChannels: []string{"b"}})
}

// Killing the listening backend makes the Listener reconnect; the new
// connection wakes every subscription (a notification sent meanwhile may be
// lost) and delivery resumes.
func TestReconnectWakesEveryoneAndResumes(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	l := New(pool, Config{Channels: []string{"alpha", "beta"}})
	defer l.Stop()
	anyA := l.Subscribe("alpha")
	p := l.SubscribePayload("alpha", "p")
	b := l.SubscribePayload("beta", "q")
	subs := []*Subscription{anyA, p, b}
	l.Start()
	for _, s := range subs {
		recv(t, s, "first connection")
	}
	for round := 1; round <= 2; round++ {
		var killed int
		if err := pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE datname = current_database() AND query LIKE 'LISTEN %'`).Scan(&killed); err != nil || killed != 1 {
			t.Fatalf("round %d: terminated %d listening backends: %v", round, killed, err)
		}
		// No notification is sent: only the reconnection can wake them,
		// and it forgets a payload not yet read.
		for _, s := range subs {
			recv(t, s, "reconnection")
			payloadIs(t, s, "", false, "after a reconnection")
		}
		if n := l.connectCount(); n != round+1 {
			t.Fatalf("round %d: %d connections, want %d", round, n, round+1)
		}
		if !l.Up() {
			t.Fatal("not Up after reconnecting")
		}
		send(t, pool, "alpha", "p")
		recv(t, p, "delivery after the reconnection")
		recv(t, anyA, "delivery after the reconnection")
		payloadIs(t, anyA, "p", true, "delivery after the reconnection")
		send(t, pool, "beta", "q")
		recv(t, b, "delivery after the reconnection")
	}
}

// A subscriber that never reads does not hold up the others: its wake-ups
// coalesce into one pending wake-up and the connection goes on dispatching.
func TestSlowSubscriberDoesNotBlock(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	l := New(pool, Config{Channels: []string{"c"}})
	defer l.Stop()
	slow := l.Subscribe("c")
	slowP := l.SubscribePayload("c", "x")
	fast := l.SubscribePayload("c", "fast")
	l.Start()
	recv(t, fast, "first connection") // slow and slowP keep theirs pending
	for range 3 {
		for range 20 {
			send(t, pool, "c", "x")
		}
		send(t, pool, "c", "fast")
		recv(t, fast, "notification behind a slow subscriber's")
	}
	if n, m := len(slow.C()), len(slowP.C()); n != 1 || m != 1 {
		t.Fatalf("pending wake-ups of slow subscribers: %d, %d; want 1, 1", n, m)
	}
}

// records is a slog.Handler that hands every record to a channel.
type records chan slog.Record

func (r records) Enabled(context.Context, slog.Level) bool { return true }
func (r records) Handle(_ context.Context, rec slog.Record) error {
	select {
	case r <- rec:
	default:
	}
	return nil
}
func (r records) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r records) WithGroup(string) slog.Handler      { return r }

func attr(rec slog.Record, key string) slog.Value {
	var v slog.Value
	rec.Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v = a.Value
			return false
		}
		return true
	})
	return v
}

// A server that cannot be reached is retried with a growing, jittered delay,
// each failure logged at Warn with the configured message.
func TestBackoffAndDownLog(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig(pgtest.AdminDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Host = t.TempDir() // a socket directory with no socket: refused at once
	cfg.ConnConfig.Fallbacks = nil
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	logs := make(records, 16)
	l := New(pool, Config{Channels: []string{"c"}, Logger: slog.New(logs), DownMsg: "down!"})
	defer l.Stop()
	l.Start()
	lo := minBackoff
	for i := range 3 {
		var rec slog.Record
		select {
		case rec = <-logs:
		case <-time.After(waitLimit):
			t.Fatalf("no log line for failure %d", i+1)
		}
		if rec.Level != slog.LevelWarn || rec.Message != "down!" {
			t.Fatalf("failure %d logged as %v %q", i+1, rec.Level, rec.Message)
		}
		if attr(rec, "err").Any() == nil || attr(rec, "channel").String() != "c" {
			t.Errorf("failure %d: attributes err=%v channel=%v", i+1, attr(rec, "err"), attr(rec, "channel"))
		}
		if d := attr(rec, "retry_in").Duration(); d < lo/2 || d >= lo {
			t.Errorf("failure %d: retry in %v, want [%v, %v)", i+1, d, lo/2, lo)
		}
		lo *= 2
	}
	if l.Up() {
		t.Fatal("Up without a server")
	}
}

// Stop ends the goroutine and the connection whether the Listener is up, down
// (waiting to retry) or never started, and a stopped Listener stays stopped.
// Not parallel: goleak looks at every goroutine of the process.
func TestStopLeavesNoGoroutines(t *testing.T) {
	dsn := pgtest.DSN(t)
	badCfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	badCfg.ConnConfig.Host = t.TempDir()
	badCfg.ConnConfig.Fallbacks = nil
	ignore := goleak.IgnoreCurrent()

	pool, err := pgxpool.New(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	bad, err := pgxpool.NewWithConfig(context.Background(), badCfg)
	if err != nil {
		t.Fatal(err)
	}

	// Up.
	up := New(pool, Config{Channels: []string{"c"}})
	s := up.Subscribe("c")
	up.Start()
	up.Start()
	recv(t, s, "first connection")
	up.Stop()
	up.Stop()
	if up.Up() {
		t.Error("Up after Stop")
	}
	up.Start() // no effect after Stop

	// Down, between two attempts.
	logs := make(records, 4)
	down := New(bad, Config{Channels: []string{"c"}, Logger: slog.New(logs)})
	down.Start()
	select {
	case <-logs:
	case <-time.After(waitLimit):
		t.Fatal("no failed attempt logged")
	}
	down.Stop()

	// Never started.
	never := New(pool, Config{Channels: []string{"c"}})
	never.Stop()
	never.Start()

	pool.Close()
	bad.Close()
	goleak.VerifyNone(t, ignore)
}
