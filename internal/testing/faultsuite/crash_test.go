package faultsuite

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/history"
	"github.com/pgfence/pgfence/internal/testing/pgserver"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/pglock"
)

// TestServerCrash runs grants and fenced writes from several goroutines
// against a server whose default is synchronous_commit = off, crashes it
// (immediate shutdown: shared memory and unflushed WAL are lost), restarts it
// and checks that no token a client was told it holds is re-issued, and that
// every acknowledged fenced write is present. The fenced writes' sessions set
// synchronous_commit = on, as the README tells applications to do; pgfence's
// grants turn it on by themselves.
func TestServerCrash(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv, err := pgserver.Start(ctx, pgserver.Options{NoContainers: true, Settings: map[string]string{"synchronous_commit": "off"}})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	setup, err := pgxpool.New(ctx, srv.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if err := migrations.UpPool(ctx, setup); err != nil {
		t.Fatal(err)
	}
	if _, err := setup.Exec(ctx, `CREATE TABLE items (id int PRIMARY KEY, v int NOT NULL, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO items SELECT g, 0, 0 FROM generate_series(0, 7) g`); err != nil {
		t.Fatal(err)
	}
	setup.Close()

	rounds := 3
	if long() {
		rounds = 20
	}
	type ack struct {
		lock  string
		token int64
		item  int
		wrote bool
	}
	// Plain releases are not flushed before they return: a crash may undo
	// the ones that returned shortly before it, which the history checks
	// allow (rec.Crashed). Grants and writes are durable.
	rec := history.New()
	rec.BoundCutAcquires() // crashes; no network delay
	var total, crashes int
	for round := range rounds {
		pcfg, err := pgxpool.ParseConfig(srv.DSN)
		if err != nil {
			t.Fatal(err)
		}
		pcfg.MaxConns = 20
		pool, err := pgxpool.NewWithConfig(ctx, pcfg)
		if err != nil {
			t.Fatal(err)
		}
		table, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: "items", Key: []string{"id"}, Set: []string{"v"}})
		if err != nil {
			t.Fatal(err)
		}
		locker, err := pglock.New(pool, &pglock.Config{Holder: fmt.Sprintf("crash-round-%d", round), PollOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		var acks []ack
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for w := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				lock := fmt.Sprintf("crash:%d", w)
				c := rec.NewClient()
				for {
					select {
					case <-stop:
						return
					default:
					}
					lease, err := c.Acquire(ctx, locker, lock, 5*time.Second, false)
					if err != nil {
						if errors.Is(err, pgfence.ErrLocked) {
							continue
						}
						return // the server went away
					}
					mu.Lock()
					acks = append(acks, ack{lock: lock, token: lease.Token(), item: w})
					i := len(acks) - 1
					mu.Unlock()
					err = c.Fenced(lock, lease.Token(), fencedwrite.Strict, fmt.Sprintf("items/%d", w), fmt.Sprint(lease.Token()), func() error {
						return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
							if _, err := tx.Exec(ctx, "SET LOCAL synchronous_commit = on"); err != nil {
								return err
							}
							_, err := table.Update(ctx, tx, lease.Token(), []any{w}, []any{int(lease.Token())})
							return err
						})
					})
					if err != nil {
						return
					}
					mu.Lock()
					acks[i].wrote = true
					mu.Unlock()
					if err := c.Release(ctx, lease); err != nil {
						return
					}
				}
			}()
		}
		time.Sleep(time.Duration(300+round*97%400) * time.Millisecond)
		rec.Crashed()
		if err := srv.Kill(syscall.SIGQUIT); err != nil {
			t.Fatal(err)
		}
		crashes++
		close(stop)
		wg.Wait()
		_ = locker.Close()
		pool.Close()
		if err := srv.Restart(ctx); err != nil {
			t.Fatal(err)
		}

		check, err := pgx.Connect(ctx, srv.DSN)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range acks {
			var token int64
			if err := check.QueryRow(ctx, "SELECT token FROM pgfence.locks WHERE name = $1", a.lock).Scan(&token); err != nil {
				t.Fatalf("lock %s after restart: %v", a.lock, err)
			}
			if token < a.token {
				t.Errorf("round %d: lock %s has token %d after restart, but a client was told it holds %d: a token would be re-issued",
					round, a.lock, token, a.token)
			}
			if a.wrote {
				var fence int64
				if err := check.QueryRow(ctx, "SELECT fence FROM items WHERE id = $1", a.item).Scan(&fence); err != nil {
					t.Fatal(err)
				}
				if fence < a.token {
					t.Errorf("round %d: acknowledged fenced write with token %d to item %d lost (fence %d)", round, a.token, a.item, fence)
				}
			}
		}
		total += len(acks)
		check.Close(ctx)
	}
	rec.Verify(t)
	t.Logf("server crash: %d crashes (immediate shutdown, synchronous_commit=off default), %d grants acknowledged, "+
		"0 tokens re-issued, 0 acknowledged fenced writes lost", crashes, total)
	if total == 0 {
		t.Fatal("no grant was acknowledged before the crashes")
	}
}
