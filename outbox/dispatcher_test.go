package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/joblimit"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/outbox"
	"github.com/pgfence/pgfence/skiplocked"
)

// counters is an observe.Metrics that counts.
type counters struct {
	mu sync.Mutex
	m  map[string]float64
}

func (c *counters) Add(_ context.Context, name string, delta float64, labels ...string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]float64{}
	}
	c.m[name+"/"+strings.Join(labels, "/")] += delta
}

func (c *counters) Observe(ctx context.Context, name string, _ float64, labels ...string) {
	c.Add(ctx, name+"#count", 1, labels...)
}

func (c *counters) get(name string, labels ...string) float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[name+"/"+strings.Join(labels, "/")]
}

var noBackoff = func(int) time.Duration { return 0 }

// TestDispatcherRetriesAndDead: every intent reaches the handler with its
// key, token and attempt number; failed attempts are retried, Permanent and
// the last attempt send the intent to dead; a job that is not an intent is
// never handed over; the metrics count each outcome.
func TestDispatcherRetriesAndDead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.grant(t, "mailer")
	const n = 20
	for i := range n {
		in := outbox.Intent{Topic: "emails", Key: fmt.Sprintf("k-%d", i), Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))}
		if i == 17 {
			in.MaxAttempts = 3
		}
		if _, err := outbox.Enqueue(b.ctx, b.pool, l, in); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := skiplocked.Enqueue(b.ctx, b.pool, skiplocked.EnqueueParams{Queue: outbox.QueuePrefix + "emails"}); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	attempts := map[string][]int{}
	h := func(ctx context.Context, d outbox.Delivery) error {
		mu.Lock()
		attempts[d.Key] = append(attempts[d.Key], d.Attempt)
		mu.Unlock()
		var p struct{ N int }
		if err := json.Unmarshal(d.Payload, &p); err != nil || d.Key != fmt.Sprintf("k-%d", p.N) || d.Token != l.Token() ||
			d.LockName != "mailer" || d.Topic != "emails" {
			return outbox.Permanent(fmt.Errorf("wrong delivery %+v", d))
		}
		switch {
		case p.N == 13:
			return outbox.Permanent(errors.New("the address does not exist"))
		case p.N == 17:
			return errors.New("mail server down")
		case p.N == 3:
			panic("handler bug")
		case p.N%5 == 0 && d.Attempt == 1:
			return errors.New("try again")
		}
		return nil
	}
	m := &counters{}
	d, err := outbox.NewDispatcher(b.pool, "emails", h, &outbox.Config{Backoff: noBackoff, PollInterval: 20 * time.Millisecond, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	sum, err := d.Drain(b.ctx)
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for i := range n {
		key := fmt.Sprintf("k-%d", i)
		want := []int{1}
		switch {
		case i == 17:
			want = []int{1, 2, 3}
		case i%5 == 0:
			want = []int{1, 2}
		}
		got := attempts[key]
		if i == 3 { // a panic is a failed attempt, every time
			if len(got) != joblimit.DefaultMaxAttempts {
				t.Errorf("%s (panics): %d attempts, want %d", key, len(got), joblimit.DefaultMaxAttempts)
			}
			continue
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("%s: attempts %v, want %v", key, got, want)
		}
	}
	st, err := outbox.Status(b.ctx, b.pool)
	if err != nil || len(st) != 1 {
		t.Fatal(st, err)
	}
	if s := st[0]; s.Topic != "emails" || s.Delivered != n-3 || s.Dead != 3 || s.Undelivered() != 0 {
		t.Errorf("status %+v, want %d delivered, 3 dead (13, 17 and the panicking 3)", s, n-3)
	}
	// The job that is not an intent went to dead without reaching the handler.
	var dead int
	if err := b.pool.QueryRow(b.ctx, "SELECT count(*) FROM pgfence.jobs j WHERE state = 'dead' AND NOT EXISTS (SELECT 1 FROM pgfence.outbox o WHERE o.id = j.id)").Scan(&dead); err != nil || dead != 1 {
		t.Errorf("stray job: %d dead, %v", dead, err)
	}
	if sum.Completed != n-3 || sum.Dead != 4 {
		t.Errorf("summary %+v", sum)
	}
	if got := m.get(metricdefs.OutboxDeliveriesTotal, "emails", metricdefs.DeliveryDelivered); got != n-3 {
		t.Errorf("delivered metric %v", got)
	}
	if got := m.get(metricdefs.OutboxDeliveriesTotal, "emails", metricdefs.DeliveryPermanent); got != 1 {
		t.Errorf("permanent metric %v", got)
	}
	if got := m.get(metricdefs.RowsDeadTotal, outbox.QueuePrefix+"emails"); got != 4 {
		t.Errorf("dead rows metric %v", got)
	}
}

// TestDispatcherPermanentNil: a handler returning Permanent(nil) sends the
// intent to dead at once, as Permanent(err) does, and the dispatcher goes on
// (it used to call Error on the nil error and crash the process). A handler
// that returns skiplocked.Permanent is a permanent failure too: its intent
// went dead, but the deliveries metric counted it as failed (and an
// outbox.Permanent's last_error read "permanent: permanent: ...").
func TestDispatcherPermanentNil(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		topic   string
		err     error
		lastErr string
	}{
		{"permnil", outbox.Permanent(nil), "permanent failure"},
		{"permout", outbox.Permanent(errors.New("gone")), "permanent: gone"},
		{"permsl", skiplocked.Permanent(errors.New("gone")), "permanent: gone"},
	} {
		b := setup(t)
		l := b.grant(t, c.topic)
		res, err := outbox.Enqueue(b.ctx, b.pool, l, outbox.Intent{Topic: c.topic, Key: "k", Payload: json.RawMessage(`{}`)})
		if err != nil {
			t.Fatal(err)
		}
		var calls atomic.Int32
		m := &counters{}
		d, err := outbox.NewDispatcher(b.pool, c.topic, func(context.Context, outbox.Delivery) error {
			calls.Add(1)
			return c.err
		}, &outbox.Config{Backoff: noBackoff, PollInterval: 20 * time.Millisecond, Metrics: m})
		if err != nil {
			t.Fatal(err)
		}
		sum, err := d.Drain(b.ctx)
		if err != nil {
			t.Fatal(err)
		}
		if sum.Dead != 1 || calls.Load() != 1 {
			t.Fatalf("%s: summary %+v after %d calls, want 1 dead after 1 call", c.topic, sum, calls.Load())
		}
		var state, lastErr string
		if err := b.pool.QueryRow(b.ctx, "SELECT state::text, last_error FROM pgfence.jobs WHERE id = $1", res.ID).Scan(&state, &lastErr); err != nil {
			t.Fatal(err)
		}
		if state != "dead" || lastErr != c.lastErr {
			t.Errorf("%s: intent's job: state %q, last_error %q; want dead, %q", c.topic, state, lastErr, c.lastErr)
		}
		if p, f := m.get(metricdefs.OutboxDeliveriesTotal, c.topic, metricdefs.DeliveryPermanent), m.get(metricdefs.OutboxDeliveriesTotal, c.topic, metricdefs.DeliveryFailed); p != 1 || f != 0 {
			t.Errorf("%s: deliveries counted permanent %v, failed %v; want 1, 0", c.topic, p, f)
		}
	}
}

// TestNewDispatcherBadInput: bad arguments are refused with typed errors.
func TestNewDispatcherBadInput(t *testing.T) {
	t.Parallel()
	b := setup(t)
	h := func(context.Context, outbox.Delivery) error { return nil }
	if _, err := outbox.NewDispatcher(nil, "emails", h, nil); !isInvalid(err, "pool") {
		t.Error(err)
	}
	for _, topic := range []string{"", strings.Repeat("t", 101), "a b", "x'; DROP TABLE y; --"} {
		if _, err := outbox.NewDispatcher(b.pool, topic, h, nil); !isInvalid(err, "topic") {
			t.Errorf("topic %q: %v", topic, err)
		}
	}
	if _, err := outbox.NewDispatcher(b.pool, "emails", nil, nil); !isInvalid(err, "h") {
		t.Error(err)
	}
	if _, err := outbox.NewDispatcher(b.pool, "emails", h, &outbox.Config{Concurrency: -1}); !isInvalid(err, "cfg") {
		t.Error(err)
	}
	for _, c := range []outbox.HTTPConfig{{}, {URL: "ftp://x"}, {URL: "http://"}, {URL: "http://x", Timeout: -1}, {URL: "http://x", Timeout: time.Hour}} {
		if _, err := outbox.NewHTTPHandler(c); !isInvalid(err, "HTTPConfig.URL") && !isInvalid(err, "HTTPConfig.Timeout") {
			t.Errorf("HTTP config %+v: %v", c, err)
		}
	}
	// Headers net/http would refuse in every attempt are refused at once.
	for _, h := range []http.Header{
		{"Bad Name": {"x"}},
		{"": {"x"}},
		{"X-Na\xc3\xafve": {"x"}},
		{"Authorization": {"Bearer a\r\nX-Evil: 1"}},
		{"X-Ok": {"fine", "bad\x00"}},
		{"X-Del": {"\x7f"}},
	} {
		if _, err := outbox.NewHTTPHandler(outbox.HTTPConfig{URL: "http://x", Header: h}); !isInvalid(err, "HTTPConfig.Header") {
			t.Errorf("header %q: %v, want ErrInvalid naming HTTPConfig.Header", h, err)
		}
	}
	ok := http.Header{"Authorization": {"Bearer abc"}, "X-Tab": {"a\tb"}, "X-Token.Chars_~!#$%&'*+^`|": {"v"}}
	if _, err := outbox.NewHTTPHandler(outbox.HTTPConfig{URL: "http://x", Header: ok}); err != nil {
		t.Errorf("header %q: %v, want accepted", ok, err)
	}
}

// TestHTTPHandler: a receiver on loopback gets each intent with its
// Idempotency-Key and token; 2xx is delivered, 409, 500, a hang past the
// timeout and a huge error body are retried, 422 is dead at once.
func TestHTTPHandler(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.grant(t, "notifier")
	var mu sync.Mutex
	seen := map[string]int{}
	var bad []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen[key]++
		n := seen[key]
		if r.Method != http.MethodPost || r.Header.Get("Pgfence-Token") != strconv.FormatInt(l.Token(), 10) ||
			r.Header.Get("Pgfence-Attempt") != strconv.Itoa(n) || r.Header.Get("Content-Type") != "application/json" ||
			r.Header.Get("Authorization") != "Bearer s3cret" || string(body) != `{"key": "`+key+`"}` {
			bad = append(bad, fmt.Sprintf("%s %v %q", r.Method, r.Header, body))
		}
		mu.Unlock()
		kind, _, _ := strings.Cut(key, "-")
		switch {
		case n > 1 || kind == "ok":
			w.WriteHeader(http.StatusCreated)
		case kind == "conflict":
			w.WriteHeader(http.StatusConflict)
		case kind == "unprocessable":
			w.WriteHeader(http.StatusUnprocessableEntity)
		case kind == "fail":
			w.WriteHeader(http.StatusInternalServerError)
		case kind == "huge":
			w.WriteHeader(http.StatusBadGateway)
			for range 1 << 10 {
				if _, err := w.Write(make([]byte, 1<<10)); err != nil {
					return
				}
			}
		case kind == "hang":
			<-r.Context().Done()
		case kind == "redirect":
			http.Redirect(w, r, "/elsewhere", http.StatusFound)
		}
	}))
	defer srv.Close()
	keys := []string{"ok-1", "ok-2", "conflict-1", "unprocessable-1", "fail-1", "huge-1", "hang-1", "redirect-1"}
	for _, k := range keys {
		if _, err := outbox.Enqueue(b.ctx, b.pool, l, outbox.Intent{Topic: "webhooks", Key: k,
			Payload: json.RawMessage(`{"key":"` + k + `"}`)}); err != nil {
			t.Fatal(err)
		}
	}
	h, err := outbox.NewHTTPHandler(outbox.HTTPConfig{URL: srv.URL + "/hook", Timeout: 2 * time.Second,
		Header: http.Header{"Authorization": {"Bearer s3cret"}}})
	if err != nil {
		t.Fatal(err)
	}
	var errMu sync.Mutex
	errs := map[string]error{}
	d, err := outbox.NewDispatcher(b.pool, "webhooks", func(ctx context.Context, d outbox.Delivery) error {
		err := h(ctx, d)
		if d.Attempt == 1 {
			errMu.Lock()
			errs[d.Key] = err
			errMu.Unlock()
		}
		return err
	}, &outbox.Config{Backoff: noBackoff, PollInterval: 20 * time.Millisecond, Concurrency: len(keys)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Drain(b.ctx); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, k := range keys {
		want := 2
		switch {
		case strings.HasPrefix(k, "ok-"), strings.HasPrefix(k, "unprocessable-"):
			want = 1
		}
		if seen[k] != want {
			t.Errorf("%s: %d requests, want %d", k, seen[k], want)
		}
	}
	for _, x := range bad {
		t.Errorf("bad request: %s", x)
	}
	var se *outbox.HTTPStatusError
	if err := errs["huge-1"]; !errors.As(err, &se) || se.StatusCode != http.StatusBadGateway || len(se.Body) != 512 {
		t.Errorf("huge body: %v", err)
	}
	if err := errs["hang-1"]; !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("hang: %v, want a deadline", err)
	}
	if err := errs["redirect-1"]; !errors.As(err, &se) || se.StatusCode != http.StatusFound {
		t.Errorf("redirect: %v, want a failed attempt with 302", err)
	}
	st, err := outbox.Status(b.ctx, b.pool)
	if err != nil || len(st) != 1 || st[0].Dead != 1 || st[0].Delivered != int64(len(keys)-1) {
		t.Fatalf("status %+v, %v; want 1 dead (422), the rest delivered", st, err)
	}
}
