package pglock

import (
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgserver"
	"github.com/pgfence/pgfence/migrations"
)

// Tokens keep growing across an immediate shutdown (SIGQUIT: crash recovery
// at restart) of a server whose default is synchronous_commit = off: the
// grant acknowledged right before the crash survives, because the grant
// statement turns synchronous_commit on for its own transaction.
func TestTokensSurviveServerCrash(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	srv, err := pgserver.Start(ctx, pgserver.Options{
		NoContainers: true,
		Settings:     map[string]string{"synchronous_commit": "off", "wal_writer_delay": "10000ms"},
	})
	if err != nil {
		t.Fatalf("start a separate server: %v", err)
	}
	t.Cleanup(func() { _ = srv.Stop() })
	open := func() *pgxpool.Pool {
		pool, err := pgxpool.New(ctx, srv.DSN)
		if err != nil {
			t.Fatal(err)
		}
		return pool
	}
	pool := open()
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
	// The migrations committed asynchronously too: make them durable, so
	// that only the grants are under test.
	if _, err := pool.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	var sc string
	if err := pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(&sc); err != nil || sc != "off" {
		t.Fatalf("server synchronous_commit = %q, %v", sc, err)
	}
	var last int64
	for round := range 3 {
		l, err := New(pool, nil)
		if err != nil {
			t.Fatal(err)
		}
		s, err := l.TryAcquire(ctx, "durable", 100*time.Millisecond)
		for retry := 0; errors.Is(err, pgfence.ErrSlowGrant) && retry < 5; retry++ {
			s, err = l.TryAcquire(ctx, "durable", 100*time.Millisecond) // given back on a loaded machine
		}
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if s.Token() <= last {
			t.Fatalf("round %d: token %d after %d", round, s.Token(), last)
		}
		last = s.Token()
		_ = l.Close()
		pool.Close()
		// Crash right after the acknowledgement.
		if err := srv.Kill(syscall.SIGQUIT); err != nil {
			t.Fatal(err)
		}
		if err := srv.Restart(ctx); err != nil {
			t.Fatal(err)
		}
		pool = open()
		info := inspect(t, pool, "durable")
		if info.Token != last {
			t.Fatalf("round %d: token after crash = %d, want the acknowledged %d", round, info.Token, last)
		}
		time.Sleep(150 * time.Millisecond) // let the 100ms lease expire
	}
	defer pool.Close()
	l, err := New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	s, err := l.Acquire(ctx, "durable", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if s.Token() != last+1 {
		t.Errorf("token after restarts %d, want %d", s.Token(), last+1)
	}
}
