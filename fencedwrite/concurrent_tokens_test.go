package fencedwrite_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestConcurrentWritersRandomTokens: eight writers share one key and write
// each of the tokens 1..n once, in random order, with a random operation
// (Upsert, Update or Modify, Strict or Reentrant), to a fenced value, a
// plain table and a partitioned table. Every write is applied or refused
// with a reason that holds: stale only below a fence the row really
// reached, never "already applied" (no token is used twice), not found
// only if no write had been applied before it started, or the documented
// retryable "changed concurrently". The row ends holding the value
// and fence of the highest token reported applied: no write reported
// applied is lost behind a lower one, and none reported refused landed
// above it.
func TestConcurrentWritersRandomTokens(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE pt (id bigint NOT NULL, v text NOT NULL, fence bigint NOT NULL DEFAULT 0, PRIMARY KEY (id)) PARTITION BY RANGE (id);
		CREATE TABLE pt_a PARTITION OF pt FOR VALUES FROM (0) TO (100);
		CREATE TABLE rt (id bigint PRIMARY KEY, v text NOT NULL, fence bigint NOT NULL DEFAULT 0)`)
	const (
		writers = 8
		tokens  = 200 // per key
		keys    = 4   // per target
	)
	modes := []fencedwrite.Mode{fencedwrite.Strict, fencedwrite.Reentrant}

	// A write of token tok to key id: op 0 Upsert, 1 Update, 2 Modify.
	type writeFunc func(tok, id int64, op int, mode fencedwrite.Mode) error
	// The stored value and fence of key id.
	type readFunc func(id int64) (v string, fence int64, err error)
	type target struct {
		write writeFunc
		read  readFunc
	}
	targets := map[string]target{
		"fenced_values": {
			write: func(tok, id int64, op int, mode fencedwrite.Mode) error {
				key := "k" + strconv.FormatInt(id, 10)
				val := json.RawMessage(strconv.Quote(strconv.FormatInt(tok, 10)))
				var err error
				switch op {
				case 0:
					_, err = fencedwrite.UpsertValue(ctx, pool, tok, mode, key, val)
				case 1:
					_, err = fencedwrite.UpdateValue(ctx, pool, tok, mode, key, val)
				default:
					_, err = fencedwrite.ModifyValue(ctx, pool, tok, key, func(json.RawMessage) (json.RawMessage, error) { return val, nil })
				}
				return err
			},
			read: func(id int64) (string, int64, error) {
				v, err := fencedwrite.GetValue(ctx, pool, "k"+strconv.FormatInt(id, 10))
				if err != nil {
					return "", 0, err
				}
				s, err := strconv.Unquote(string(v.Value))
				return s, v.Fence, err
			},
		},
	}
	for _, table := range []string{"pt", "rt"} {
		tabs := map[fencedwrite.Mode]*fencedwrite.Table{}
		for _, m := range modes {
			tabs[m] = prepare(t, pool, fencedwrite.Spec{Table: table, Key: []string{"id"}, Set: []string{"v"}, Mode: m})
		}
		targets[table] = target{
			write: func(tok, id int64, op int, mode fencedwrite.Mode) error {
				tab, v := tabs[mode], strconv.FormatInt(tok, 10)
				var err error
				switch op {
				case 0:
					_, err = tab.Upsert(ctx, pool, tok, []any{id}, []any{v})
				case 1:
					_, err = tab.Update(ctx, pool, tok, []any{id}, []any{v})
				default:
					_, err = tab.Modify(ctx, pool, tok, []any{id}, func([]any) ([]any, error) { return []any{v}, nil })
				}
				return err
			},
			read: func(id int64) (string, int64, error) {
				var v string
				var f int64
				err := pool.QueryRow(ctx, "SELECT v, fence FROM "+table+" WHERE id = $1", id).Scan(&v, &f)
				return v, f, err
			},
		}
	}

	for name, tg := range targets {
		for id := int64(1); id <= keys; id++ {
			var (
				mu        sync.Mutex
				maxOK     int64 // the highest token applied
				staleSeen int64 // the highest fence a stale refusal reported
				exists    bool  // a write was reported applied: the row exists from then on
				counts    = map[string]int{}
			)
			order := make(chan int64, tokens)
			for _, p := range rand.Perm(tokens) {
				order <- int64(p + 1)
			}
			close(order)
			var wg sync.WaitGroup
			for range writers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for tok := range order {
						op, mode := rand.IntN(3), modes[rand.IntN(len(modes))]
						mu.Lock()
						existed := exists
						mu.Unlock()
						err := tg.write(tok, id, op, mode)
						var pe *pgfence.Error
						mu.Lock()
						switch {
						case err == nil:
							maxOK, exists = max(maxOK, tok), true
							counts["applied"]++
						case errors.Is(err, pgfence.ErrStaleToken) && errors.As(err, &pe):
							var fence int64
							if _, serr := fmt.Sscanf(pe.Reason, "row fence %d > token", &fence); serr != nil || fence <= tok || pe.Token != tok {
								t.Errorf("%s id %d: token %d refused as stale with %+v", name, id, tok, pe)
							}
							staleSeen = max(staleSeen, fence)
							counts["stale"]++
						case errors.Is(err, pgfence.ErrNotFound):
							if existed {
								t.Errorf("%s id %d: token %d (op %d) found no row after a write had been applied (nothing deletes it)", name, id, tok, op)
							}
							counts["not found"]++
						case pgfence.IsRetryable(err) && errors.As(err, &pe) && pe.Kind == nil &&
							strings.HasPrefix(pe.Reason, "refused, but the row changed concurrently"):
							// The row changed between the statement and the
							// read that explains its refusal (it appeared
							// under an Update, or under a partitioned
							// table's Upsert: see
							// TestTablePartitionedUpsertConcurrentInsert).
							counts["retryable"]++
						default:
							t.Errorf("%s id %d: token %d (op %d, %v): unexpected error %v", name, id, tok, op, mode, err)
						}
						mu.Unlock()
					}
				}()
			}
			wg.Wait()
			v, fence, err := tg.read(id)
			switch {
			case maxOK == 0:
				t.Errorf("%s id %d: no write of %d was applied", name, id, tokens)
			case err != nil:
				t.Errorf("%s id %d: read the row: %v", name, id, err)
			case v != strconv.FormatInt(maxOK, 10) || fence != maxOK:
				t.Errorf("%s id %d: row holds %q with fence %d; the highest token applied is %d", name, id, v, fence, maxOK)
			}
			if staleSeen > fence {
				t.Errorf("%s id %d: a refusal reported fence %d, above the row's final fence %d", name, id, staleSeen, fence)
			}
			t.Logf("%s id %d: highest applied %d, outcomes %v", name, id, maxOK, counts)
		}
	}
}
