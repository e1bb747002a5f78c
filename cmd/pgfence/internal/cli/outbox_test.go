package cli

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/outbox"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// TestOutboxCommand: `pgfence outbox` counts intents per topic and state,
// --topic one topic, --json the same as JSON; a topic with no intents exits
// 3, a bad topic name 2, an unmigrated database 4.
func TestOutboxCommand(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	locker, err := pglock.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.Acquire(ctx, "settle", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Release(context.Background())
	for i, topic := range []string{"payments", "payments", "payments", "emails"} {
		in := outbox.Intent{Topic: topic, Key: "k" + string(rune('a'+i)), Payload: json.RawMessage(`{}`), MaxAttempts: 1}
		if _, err := outbox.Enqueue(ctx, pool, lease, in); err != nil {
			t.Fatal(err)
		}
	}
	jobs, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "outbox:payments", Holder: "d", Limit: 2, TTL: time.Minute})
	if err != nil || len(jobs) != 2 {
		t.Fatal(jobs, err)
	}
	if _, err := skiplocked.Fail(ctx, pool, jobs[0].Ref(), skiplocked.FailParams{Error: "receiver down"}); err != nil {
		t.Fatal(err)
	}

	r := run(t, dsn, "outbox")
	if r.code != 0 {
		t.Fatalf("outbox: %+v", r)
	}
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != 3 || strings.Join(strings.Fields(lines[0]), " ") != "TOPIC PENDING RETRYING IN FLIGHT EXPIRED DELIVERED DEAD OLDEST" {
		t.Fatalf("outbox printed:\n%s", r.stdout)
	}
	for i, want := range []string{"emails 1 0 0 0 0 0", "payments 1 0 1 0 0 1"} {
		f := strings.Fields(lines[i+1])
		if got := strings.Join(f[:len(f)-1], " "); got != want || !strings.HasSuffix(f[len(f)-1], "s") {
			t.Errorf("line %d = %q, want %q and an age", i+1, lines[i+1], want)
		}
	}

	r = run(t, dsn, "outbox", "--topic", "payments", "--json")
	var views []outboxView
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &views) != nil || len(views) != 1 {
		t.Fatalf("outbox --topic --json: %+v", r)
	}
	if v := views[0]; v.Topic != "payments" || v.Pending != 1 || v.InFlight != 1 || v.Dead != 1 || v.OldestUndeliveredSeconds <= 0 {
		t.Errorf("view %+v", v)
	}
	if r := run(t, dsn, "outbox", "--topic", "payment"); r.code != ExitNotFound || !strings.Contains(r.stderr, "no intents") {
		t.Errorf("misspelt topic: %+v, want exit %d", r, ExitNotFound)
	}
	if r := run(t, dsn, "outbox", "--topic", "a'; DROP TABLE x; --"); r.code != ExitUsage {
		t.Errorf("bad topic: %+v, want exit %d", r, ExitUsage)
	}
	if r := run(t, pgtest.EmptyDSN(t), "outbox"); r.code != ExitNotMigrated {
		t.Errorf("unmigrated database: %+v", r)
	}
}
