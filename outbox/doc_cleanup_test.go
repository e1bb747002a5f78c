package outbox_test

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgfence/pgfence/outbox"
)

// docCleanup returns the intent clean-up statement of docs/outbox.md.
func docCleanup(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../docs/outbox.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	i := strings.Index(doc, "DELETE FROM pgfence.outbox o")
	if i < 0 {
		t.Fatal("docs/outbox.md has no clean-up statement (DELETE FROM pgfence.outbox o ...)")
	}
	j := strings.Index(doc[i:], ";")
	if j < 0 {
		t.Fatal("docs/outbox.md: the clean-up statement has no end")
	}
	return doc[i : i+j]
}

// TestDocCleanupKeepsUndelivered: the clean-up docs/outbox.md gives for old
// intents deletes delivered ones (their job completed, or already pruned)
// and keeps one still waiting for delivery, which is then delivered. The
// statement it gave before deleted every intent older than 90 days: the
// waiting intent's job then went dead ("no outbox intent") unseen, and its
// key was free for a second intent.
func TestDocCleanupKeepsUndelivered(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.grant(t, "cleanup")
	done, err := outbox.Enqueue(b.ctx, b.pool, l, outbox.Intent{Topic: "cleanup", Key: "done", Payload: json.RawMessage(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	d, err := outbox.NewDispatcher(b.pool, "cleanup", func(context.Context, outbox.Delivery) error { return nil },
		&outbox.Config{PollOnly: true, PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Drain(b.ctx); err != nil {
		t.Fatal(err)
	}
	waiting, err := outbox.Enqueue(b.ctx, b.pool, l, outbox.Intent{Topic: "cleanup", Key: "later",
		Payload: json.RawMessage(`{}`), NotBefore: time.Now().Add(100 * 24 * time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	// 91 days pass.
	if _, err := b.pool.Exec(b.ctx, `UPDATE pgfence.outbox SET created_at = created_at - interval '91 days'`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.pool.Exec(b.ctx, docCleanup(t)); err != nil {
		t.Fatal(err)
	}
	var left []int64
	rows, err := b.pool.Query(b.ctx, `SELECT id FROM pgfence.outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		left = append(left, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(left) != 1 || left[0] != waiting.ID {
		t.Fatalf("intents left after the documented clean-up: %v; want only the waiting one %d (delivered %d deleted)", left, waiting.ID, done.ID)
	}
	// Its time comes, and it is delivered.
	if _, err := b.pool.Exec(b.ctx, `UPDATE pgfence.jobs SET run_at = now() WHERE id = $1`, waiting.ID); err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	d2, err := outbox.NewDispatcher(b.pool, "cleanup", func(context.Context, outbox.Delivery) error { calls.Add(1); return nil },
		&outbox.Config{PollOnly: true, PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if sum, err := d2.Drain(b.ctx); err != nil || calls.Load() != 1 || sum.Dead != 0 {
		t.Fatalf("the kept intent: %d deliveries, summary %+v, %v; want 1 delivery", calls.Load(), sum, err)
	}
}
