package skiplocked

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// holdFail is a pgx tracer that holds back the first job_fail statement's
// return until release is closed: the writer then sits between writing the
// failure and removing the claim from the worker's in-flight claims.
type holdFail struct {
	once    sync.Once
	written chan struct{} // closed when the first job_fail has returned
	release chan struct{}
}

type sqlKey struct{}

func (h *holdFail) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, sqlKey{}, d.SQL)
}

func (h *holdFail) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	sql, _ := ctx.Value(sqlKey{}).(string)
	if !strings.Contains(sql, "job_fail") || d.Err != nil {
		return
	}
	first := false
	h.once.Do(func() { first = true })
	if first {
		close(h.written)
		<-h.release
	}
}

// A job whose failure is retried at once can be claimed again by the same
// worker before the writer that wrote the failure has removed the earlier
// claim from the worker's in-flight claims. Removing it by job id took out
// the new claim's entry: that claim was never renewed (it expired under its
// running handler, and another worker could run the job beside it) and its
// handler never heard it was lost. Each claim now has its own entry.
func TestReclaimKeepsNewClaim(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	tr := &holdFail{written: make(chan struct{}), release: make(chan struct{})}
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = tr
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ids, err := Enqueue(ctx, pool, EnqueueParams{Queue: "reclaim", Payload: json.RawMessage(`{}`), MaxAttempts: 5})
	if err != nil {
		t.Fatal(err)
	}

	second := make(chan ClaimRef, 1)
	finish := make(chan struct{})
	w, err := NewWorker(pool, "reclaim", func(ctx context.Context, j Job) error {
		if j.Attempts == 1 {
			return errors.New("first attempt fails")
		}
		second <- j.Ref()
		select {
		case <-finish:
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}, &Config{Concurrency: 1, BatchSize: 1, PollOnly: true, PollInterval: 10 * time.Millisecond,
		Backoff: func(int) time.Duration { return 0 }})
	if err != nil {
		t.Fatal(err)
	}
	removed := make(chan struct{}, 8)
	w.outcomesHook = func() { removed <- struct{}{} }

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(runCtx) }()
	var finishOnce sync.Once
	end := func() { finishOnce.Do(func() { close(finish) }) }
	defer func() {
		end()
		stop()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()

	select {
	case <-tr.written:
	case <-ctx.Done():
		t.Fatal("the first attempt's failure was never written")
	}
	// The failure is written (the job is due again at once) and its writer
	// is held: the worker claims the job again and starts its handler.
	var ref ClaimRef
	select {
	case ref = <-second:
	case <-ctx.Done():
		t.Fatal("the job was not claimed again")
	}
	if ref.JobID != ids[0] {
		t.Fatalf("second attempt of job %d, want %d", ref.JobID, ids[0])
	}
	close(tr.release)
	select {
	case <-removed:
	case <-ctx.Done():
		t.Fatal("the writer never removed the first claim")
	}
	w.mu.Lock()
	h, ok := w.inflight[ref]
	n := len(w.inflight)
	w.mu.Unlock()
	if !ok || h.ref != ref {
		t.Fatalf("the second claim (token %d) is not among the worker's %d in-flight claims after the first claim's outcome was written: it would not be renewed", ref.Token, n)
	}
	end()
}
