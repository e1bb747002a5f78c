package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/outbox"
)

// TestEnqueueNotBeforeRange: a NotBefore outside years 1..9999 is refused
// before any SQL runs. time.Unix(math.MaxInt64, 0), a common "never",
// overflowed in pgx's encoding and was stored as 1969: due at once.
func TestEnqueueNotBeforeRange(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.grant(t, "input:notbefore")
	for i, nb := range []time.Time{time.Unix(math.MaxInt64, 0), time.Unix(math.MinInt64, 0),
		time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(0, 12, 31, 0, 0, 0, 0, time.UTC)} {
		in := intent("input:nb:" + string(rune('a'+i)))
		in.NotBefore = nb
		_, err := outbox.Enqueue(b.ctx, b.pool, l, in)
		var pe *pgfence.Error
		if !errors.Is(err, pgfence.ErrInvalid) || !errors.As(err, &pe) || !strings.HasPrefix(pe.Reason, "Intent.NotBefore:") {
			t.Errorf("NotBefore %v: %v; want ErrInvalid naming Intent.NotBefore", nb, err)
		}
	}
	var n int
	if err := b.pool.QueryRow(b.ctx, "SELECT count(*) FROM pgfence.outbox WHERE idempotency_key LIKE 'input:nb:%'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d intents recorded (%v), want none", n, err)
	}
	// The range's ends are accepted, and stored as given.
	in := intent("input:nb:late")
	in.NotBefore = time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)
	r, err := outbox.Enqueue(b.ctx, b.pool, l, in)
	if err != nil {
		t.Fatal(err)
	}
	var runAt time.Time
	if err := b.pool.QueryRow(b.ctx, "SELECT run_at FROM pgfence.jobs WHERE id = $1", r.ID).Scan(&runAt); err != nil || !runAt.Equal(in.NotBefore) {
		t.Fatalf("run_at %v (%v), want %v", runAt, err, in.NotBefore)
	}
}

// TestEnqueuePayloadNumbers: a JSON number jsonb cannot store is refused
// with ErrInvalid naming the payload (it was an untyped 22003).
func TestEnqueuePayloadNumbers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.grant(t, "input:numbers")
	for i, p := range []string{`{"n":1e1000000}`, `{"n":1e-1000000}`, `[1e131072]`} {
		in := intent("input:num:" + string(rune('a'+i)))
		in.Payload = json.RawMessage(p)
		_, err := outbox.Enqueue(b.ctx, b.pool, l, in)
		var pe *pgfence.Error
		if !errors.Is(err, pgfence.ErrInvalid) || !errors.As(err, &pe) || !strings.HasPrefix(pe.Reason, "Intent.Payload:") || pe.Name != l.Name() {
			t.Errorf("payload %s: %v; want ErrInvalid naming Intent.Payload and the lock", p, err)
		}
	}
	in := intent("input:num:ok")
	in.Payload = json.RawMessage(`{"n":1e1000}`)
	if _, err := outbox.Enqueue(b.ctx, b.pool, l, in); err != nil {
		t.Fatalf("a number jsonb stores: %v", err)
	}
}

// TestHTTPHeaderSpelling: a configured header spelled in lower case is sent
// once under its canonical name, and the handler's own headers replace it
// (a second Idempotency-Key went out beside the intent's).
func TestHTTPHeaderSpelling(t *testing.T) {
	t.Parallel()
	var got atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		got.Store(r.Header.Clone())
	}))
	defer srv.Close()
	h, err := outbox.NewHTTPHandler(outbox.HTTPConfig{URL: srv.URL, Header: http.Header{
		"idempotency-key": {"static"}, "content-type": {"text/plain"}, "x-tenant": {"a"}, "X-Tenant": {"b"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if err := h(context.Background(), outbox.Delivery{ID: 1, Topic: "t", Key: "payout:7", Token: 3,
		Payload: json.RawMessage(`{}`), Attempt: 1}); err != nil {
		t.Fatal(err)
	}
	hd := got.Load().(http.Header)
	if v := hd.Values("Idempotency-Key"); len(v) != 1 || v[0] != "payout:7" {
		t.Errorf("Idempotency-Key %q, want only the intent's key", v)
	}
	if v := hd.Values("Content-Type"); len(v) != 1 || v[0] != "application/json" {
		t.Errorf("Content-Type %q, want only application/json", v)
	}
	if v := hd.Values("X-Tenant"); len(v) != 2 {
		t.Errorf("X-Tenant %q, want both configured values", v)
	}
}

// TestSecondRunKeepsIntents: a second Run, refused, leaves the running
// call's claimed intents alone (it forgot them all, and each delivery read
// its intent again).
func TestSecondRunKeepsIntents(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.grant(t, "input:run2")
	for _, k := range []string{"k1", "k2", "k3", "k4"} {
		in := intent("input:run2:" + k)
		in.Topic = "input-run2"
		if _, err := outbox.Enqueue(b.ctx, b.pool, l, in); err != nil {
			t.Fatal(err)
		}
	}
	started, release := make(chan struct{}, 8), make(chan struct{})
	d, err := outbox.NewDispatcher(b.pool, "input-run2", func(ctx context.Context, _ outbox.Delivery) error {
		started <- struct{}{}
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}, &outbox.Config{Concurrency: 1, BatchSize: 3, PollOnly: true, PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(b.ctx)
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	<-started
	before := d.Kept()
	if before == 0 {
		t.Fatal("the dispatcher keeps no intent while it delivers the first of a batch of 3")
	}
	if err := d.Run(b.ctx); err == nil {
		t.Fatal("second Run: nil error")
	}
	if _, err := d.Drain(b.ctx); err == nil {
		t.Fatal("Drain after Run: nil error")
	}
	after := d.Kept()
	close(release)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if after != before {
		t.Errorf("a refused second Run dropped the running call's kept intents: %d -> %d", before, after)
	}
}
