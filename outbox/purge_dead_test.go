package outbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgfence/pgfence/outbox"
	"github.com/pgfence/pgfence/skiplocked"
)

// TestPurgeKeepsDeadIntents: skiplocked.DeleteFinished (pgfence.job_purge)
// keeps the dead job of an outbox intent, which Status and the retry UPDATE
// need (before migration 00018 the intent vanished from Status), until the
// intent itself is deleted; a dead job of another queue is purged as before.
func TestPurgeKeepsDeadIntents(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.grant(t, "purge:dead")
	in := intent("purge:dead:1")
	in.Topic = "purge-dead"
	r, err := outbox.Enqueue(b.ctx, b.pool, l, in)
	if err != nil {
		t.Fatal(err)
	}
	d, err := outbox.NewDispatcher(b.pool, "purge-dead", func(context.Context, outbox.Delivery) error {
		return outbox.Permanent(errors.New("receiver refused"))
	}, &outbox.Config{PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Drain(b.ctx); err != nil {
		t.Fatal(err)
	}
	// A dead job of a plain queue beside it.
	ids, err := skiplocked.Enqueue(b.ctx, b.pool, skiplocked.EnqueueParams{Queue: "purge-plain", MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	w, err := skiplocked.NewWorker(b.pool, "purge-plain", func(context.Context, skiplocked.Job) error {
		return errors.New("fails")
	}, &skiplocked.Config{PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Drain(b.ctx); err != nil {
		t.Fatal(err)
	}
	dead := func() int64 {
		t.Helper()
		st, err := outbox.Status(b.ctx, b.pool)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range st {
			if s.Topic == "purge-dead" {
				return s.Dead
			}
		}
		return -1
	}
	if n := dead(); n != 1 {
		t.Fatalf("dead intents of the topic before the purge: %d, want 1", n)
	}
	if _, err := skiplocked.DeleteFinished(b.ctx, b.pool, time.Now().Add(time.Hour), 100); err != nil {
		t.Fatal(err)
	}
	if n := dead(); n != 1 {
		t.Fatalf("after DeleteFinished the topic reports %d dead intents (-1: topic absent), want 1: the intent's job was purged", n)
	}
	var plain int
	if err := b.pool.QueryRow(b.ctx, "SELECT count(*) FROM pgfence.jobs WHERE id = $1", ids[0]).Scan(&plain); err != nil || plain != 0 {
		t.Fatalf("the dead job of a plain queue: %d rows left (%v), want it purged", plain, err)
	}
	// Once the intent is deleted, its job goes with the next purge.
	if _, err := b.pool.Exec(b.ctx, "DELETE FROM pgfence.outbox WHERE id = $1", r.ID); err != nil {
		t.Fatal(err)
	}
	if n, err := skiplocked.DeleteFinished(b.ctx, b.pool, time.Now().Add(time.Hour), 100); err != nil || n != 1 {
		t.Fatalf("purge after the intent was deleted: %d, %v; want its job (1)", n, err)
	}
}
