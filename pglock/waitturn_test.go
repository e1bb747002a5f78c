package pglock

import (
	"context"
	"testing"
	"time"
)

// waitTurn, driven by hand-fed channels: a wake-up during the backoff is
// held back until the backoff ends, never lost; the timer ends the wait even
// during the backoff (a waiter must not then sleep until a wake-up that may
// never come: the lock may be free with nobody left to release it); ctx and
// Close end it.
func TestWaitTurn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	never := make(chan time.Time)
	closed := make(chan struct{})
	type result struct {
		end   turnEnd
		woken bool
	}
	run := func(ctx context.Context, closed chan struct{}, wake chan struct{}, timer, backoff <-chan time.Time) <-chan result {
		ch := make(chan result, 1)
		go func() {
			end, woken := waitTurn(ctx, closed, wake, nil, timer, backoff)
			ch <- result{end, woken}
		}()
		return ch
	}

	// The timer fires during the backoff: try again at once.
	timer, backoff := make(chan time.Time, 1), make(chan time.Time, 1)
	wake := make(chan struct{}, 1)
	res := run(ctx, closed, wake, timer, backoff)
	timer <- time.Now()
	if r := <-res; r != (result{turnNext, false}) {
		t.Errorf("timer during the backoff: %+v, want turnNext, not woken", r)
	}

	// A wake-up during the backoff waits for the backoff, then counts.
	backoff = make(chan time.Time, 1)
	wake <- struct{}{}
	res = run(ctx, closed, wake, never, backoff)
	select {
	case r := <-res:
		t.Fatalf("returned %+v before the backoff ended", r)
	case <-time.After(20 * time.Millisecond): // asserting that nothing happens needs a bound
	}
	backoff <- time.Now()
	if r := <-res; r != (result{turnNext, true}) {
		t.Errorf("wake-up after the backoff: %+v, want turnNext, woken", r)
	}

	// No backoff: a wake-up ends the wait at once.
	wake <- struct{}{}
	if r := <-run(ctx, closed, wake, never, nil); r != (result{turnNext, true}) {
		t.Errorf("wake-up without backoff: %+v", r)
	}

	// ctx and Close end it, backoff or not.
	cctx, cancel := context.WithCancel(ctx)
	res = run(cctx, closed, wake, never, make(chan time.Time))
	cancel()
	if r := <-res; r.end != turnCtxDone {
		t.Errorf("ctx cancelled: %+v", r)
	}
	res = run(ctx, closed, wake, never, make(chan time.Time))
	close(closed)
	if r := <-res; r.end != turnClosed {
		t.Errorf("Locker closed: %+v", r)
	}
}
