package faultsuite

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock"
)

// storage modes of seed 002, scenario 5.
type storageMode int

const (
	noFencing storageMode = iota
	fencedWritesOnly
	fencedReadsAndWrites
)

func (m storageMode) String() string {
	return [...]string{"no fencing", "fenced writes only", "fenced reads and writes"}[m]
}

// orderings returns every interleaving of two clients' three steps (acquire,
// read, write: "AAA", "BBB") with two pauses ("PP"): 8!/(3!·3!·2!) = 560.
func orderings() []string {
	var out []string
	var rec func(prefix string, a, b, p int)
	rec = func(prefix string, a, b, p int) {
		if a == 0 && b == 0 && p == 0 {
			out = append(out, prefix)
			return
		}
		if a > 0 {
			rec(prefix+"A", a-1, b, p)
		}
		if b > 0 {
			rec(prefix+"B", a, b-1, p)
		}
		if p > 0 {
			rec(prefix+"P", a, b, p-1)
		}
	}
	rec("", 3, 3, 2)
	return out
}

type orderingResult struct {
	ordering string
	lost     bool
	accepted int
	rejected int
	final    int
	want     int
}

// runOrdering plays one ordering against real PostgreSQL: each client takes
// the lease with TryAcquire (a client refused the lease does nothing more),
// reads the balance, and writes read+amount. A pause lets every lease run out
// on the database clock. An update is lost when the final balance differs from
// the start plus the amounts of all accepted writes.
func runOrdering(ctx context.Context, pool *pgxpool.Pool, lockers map[byte]*pglock.Locker, table *fencedwrite.Table,
	mode storageMode, ordering string, id int, ttl time.Duration) (orderingResult, error) {
	const start = 100
	amounts := map[byte]int{'A': 50, 'B': 10}
	res := orderingResult{ordering: ordering}
	lock := fmt.Sprintf("ordering:%d:%d", mode, id)
	if _, err := pool.Exec(ctx, "INSERT INTO balances(id, balance) VALUES ($1, $2)", id, start); err != nil {
		return res, err
	}
	type client struct {
		step    int
		refused bool
		token   int64
		read    int
	}
	clients := map[byte]*client{'A': {}, 'B': {}}
	acceptedSum := 0
	for i := 0; i < len(ordering); i++ {
		who := ordering[i]
		if who == 'P' {
			time.Sleep(ttl + ttl/2)
			continue
		}
		c := clients[who]
		step := c.step
		c.step++
		if c.refused {
			continue
		}
		switch step {
		case 0: // acquire
			lease, err := lockers[who].TryAcquire(ctx, lock, ttl)
			// On a loaded machine a grant can come back after its TTL:
			// pglock gives it back (ErrSlowGrant, retryable); take it again.
			for tries := 1; errors.Is(err, pgfence.ErrSlowGrant) && tries < 5; tries++ {
				lease, err = lockers[who].TryAcquire(ctx, lock, ttl)
			}
			if errors.Is(err, pgfence.ErrLocked) {
				c.refused = true
				continue
			}
			if err != nil {
				return res, err
			}
			c.token = lease.Token()
		case 1: // read
			var err error
			if mode == fencedReadsAndWrites {
				_, err = table.Read(ctx, pool, c.token, []any{id}, &c.read)
				if errors.Is(err, pgfence.ErrStaleToken) {
					// Fenced out already at the read: this client stops.
					res.rejected++
					c.refused = true
					continue
				}
			} else {
				err = pool.QueryRow(ctx, "SELECT balance FROM balances WHERE id = $1", id).Scan(&c.read)
			}
			if err != nil {
				return res, err
			}
		case 2: // write
			nb := c.read + amounts[who]
			if mode == noFencing {
				if _, err := pool.Exec(ctx, "UPDATE balances SET balance = $1 WHERE id = $2", nb, id); err != nil {
					return res, err
				}
			} else {
				_, err := table.Update(ctx, pool, c.token, []any{id}, []any{nb})
				if errors.Is(err, pgfence.ErrStaleToken) {
					res.rejected++
					continue
				}
				if err != nil {
					return res, err
				}
			}
			res.accepted++
			acceptedSum += amounts[who]
		}
	}
	if err := pool.QueryRow(ctx, "SELECT balance FROM balances WHERE id = $1", id).Scan(&res.final); err != nil {
		return res, err
	}
	res.want = start + acceptedSum
	res.lost = res.final != res.want
	return res, nil
}

// TestEveryOrdering is seed 002's scenario 5 against real PostgreSQL with
// pgfence's lease and three storage modes. With fenced reads and writes no
// ordering may lose an update; the other two modes must lose some, which shows
// the suite catches a lost update when fencing is disabled.
func TestEveryOrdering(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := bigPool(t, pgtest.DSN(t), 40)
	if _, err := pool.Exec(ctx, `CREATE TABLE balances (id int PRIMARY KEY, balance int NOT NULL, fence bigint NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	table, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{
		Table: "balances", Key: []string{"id"}, Set: []string{"balance"}, Read: []string{"balance"}, Mode: fencedwrite.Reentrant,
	})
	if err != nil {
		t.Fatal(err)
	}
	lockers := map[byte]*pglock.Locker{}
	for _, who := range []byte("AB") {
		l, err := pglock.New(pool, &pglock.Config{Holder: "client-" + string(who), PollOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		lockers[who] = l
	}
	all := orderings()
	if len(all) != 560 {
		t.Fatalf("%d orderings, want 560", len(all))
	}
	const ttl = 2 * time.Second
	summary := []string{}
	lostBy := map[storageMode]int{}
	for mode := noFencing; mode <= fencedReadsAndWrites; mode++ {
		results := make([]orderingResult, len(all))
		errs := make([]error, len(all))
		var wg sync.WaitGroup
		for i, o := range all {
			wg.Add(1)
			go func() {
				defer wg.Done()
				results[i], errs[i] = runOrdering(ctx, pool, lockers, table, mode, o, int(mode)*1000+i, ttl)
			}()
		}
		wg.Wait()
		lost, rejected, firstLost := 0, 0, "-"
		for i, r := range results {
			if errs[i] != nil {
				t.Fatalf("%s, ordering %s: %v", mode, all[i], errs[i])
			}
			rejected += r.rejected
			if r.lost {
				if lost == 0 {
					firstLost = r.ordering
				}
				lost++
			}
		}
		lostBy[mode] = lost
		summary = append(summary, fmt.Sprintf("%-24s orderings %d  lost updates %3d  stale requests rejected %3d  first losing ordering %s",
			mode, len(all), lost, rejected, firstLost))
	}
	t.Logf("every ordering (A/B = that client's next step, P = pause past the lease):\n%s", strings.Join(summary, "\n"))
	if lostBy[fencedReadsAndWrites] != 0 {
		t.Errorf("fenced reads and writes lost %d updates, want 0", lostBy[fencedReadsAndWrites])
	}
	if lostBy[noFencing] == 0 || lostBy[fencedWritesOnly] == 0 {
		t.Errorf("the unfenced modes lost no update (%v): the suite would not catch a lost update", lostBy)
	}
	if lostBy[fencedWritesOnly] >= lostBy[noFencing] {
		t.Errorf("fencing writes only lost %d, no fencing %d: want fewer", lostBy[fencedWritesOnly], lostBy[noFencing])
	}
}
