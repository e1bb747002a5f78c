package skiplocked_test

import (
	"encoding/json"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// TestEnqueueRunAtRange: a RunAt outside years 1..9999 is refused before
// any SQL runs (time.Unix(math.MaxInt64, 0) overflowed in pgx's encoding
// and made the job due at once); so is such a DeleteFinished bound; and a
// payload number jsonb cannot store is ErrInvalid naming the payload.
func TestEnqueueRunAtRange(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	never := time.Unix(math.MaxInt64, 0)
	for _, c := range []struct {
		ps  []skiplocked.EnqueueParams
		arg string
	}{
		{[]skiplocked.EnqueueParams{{Queue: "range", RunAt: never}}, "RunAt:"},
		{[]skiplocked.EnqueueParams{{Queue: "range"}, {Queue: "range", RunAt: time.Unix(math.MinInt64, 0)}}, "ps[1].RunAt:"},
		{[]skiplocked.EnqueueParams{{Queue: "range", RunAt: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}}, "RunAt:"},
		{[]skiplocked.EnqueueParams{{Queue: "range", Payload: json.RawMessage(`{"n":1e1000000}`)}}, "Payload:"},
	} {
		_, err := skiplocked.Enqueue(ctx, pool, c.ps...)
		var pe *pgfence.Error
		if !errors.Is(err, pgfence.ErrInvalid) || !errors.As(err, &pe) || !strings.HasPrefix(pe.Reason, c.arg) {
			t.Errorf("%+v: %v; want ErrInvalid naming %s", c.ps, err, c.arg)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgfence.jobs WHERE queue = 'range'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d jobs enqueued (%v), want none", n, err)
	}
	if _, err := skiplocked.DeleteFinished(ctx, pool, time.Unix(math.MinInt64, 0), 10); !errors.Is(err, pgfence.ErrInvalid) {
		t.Errorf("DeleteFinished before year 1: %v, want ErrInvalid", err)
	}
}
