package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/pglock"
)

func (a *app) demoWorkerCommand() *cobra.Command {
	var name, lock, table string
	var amount int
	var ttl time.Duration
	var fenced bool
	cmd := &cobra.Command{
		Use:    "demo-worker",
		Short:  "one worker of 'pgfence demo' (internal)",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			pool, err := a.connect(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			locker, err := pglock.New(pool, &pglock.Config{Holder: fmt.Sprintf("demo-%s/%d", name, os.Getpid())})
			if err != nil {
				return err
			}
			defer locker.Close()
			w := &worker{name: name, pool: pool, locker: locker, lock: lock, ttl: ttl, fenced: fenced,
				table: pgx.Identifier(strings.SplitN(table, ".", 2)).Sanitize(), amount: amount,
				enc: json.NewEncoder(a.env.Stdout), in: bufio.NewScanner(a.env.Stdin)}
			if fenced {
				// Re-entrant: the fenced read raises the fence to our token, and
				// our own write must then pass with the same token.
				w.fw, err = fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{
					Table: table, Key: []string{"id"}, Set: []string{"balance"}, Mode: fencedwrite.Reentrant,
				})
				if err != nil {
					return err
				}
			}
			return w.run(ctx)
		},
	}
	f := cmd.Flags()
	f.StringVar(&name, "name", "", "")
	f.StringVar(&lock, "lock", "", "")
	f.StringVar(&table, "table", "", "")
	f.IntVar(&amount, "amount", 0, "")
	f.DurationVar(&ttl, "ttl", time.Second, "")
	f.BoolVar(&fenced, "fenced", false, "")
	return cmd
}

type worker struct {
	name   string
	pool   *pgxpool.Pool
	locker *pglock.Locker
	lock   string
	ttl    time.Duration
	fenced bool
	table  string
	fw     *fencedwrite.Table
	amount int
	enc    *json.Encoder
	in     *bufio.Scanner
}

func (w *worker) emit(e demoEvent) { e.Who = w.name; _ = w.enc.Encode(e) }

func (w *worker) run(ctx context.Context) error {
	defer w.emit(demoEvent{Ev: "exit"})
	rejected, err := w.cycle(ctx, true)
	if err != nil {
		return err
	}
	if rejected {
		w.emit(demoEvent{Ev: "retry"})
		if _, err := w.cycle(ctx, false); err != nil {
			return err
		}
	}
	return nil
}

// cycle is acquire → read → (wait for the parent) → write → release. It
// reports whether the write was rejected as stale.
func (w *worker) cycle(ctx context.Context, waitForGo bool) (bool, error) {
	lease, err := w.locker.Acquire(ctx, w.lock, w.ttl)
	if err != nil {
		return false, err
	}
	tok := lease.Token()
	w.emit(demoEvent{Ev: "granted", Token: tok})

	var balance int
	if w.fenced {
		// Fenced read: raise the row's fence to our token, so an older holder's
		// later write is refused.
		_, err = w.fw.Read(ctx, w.pool, tok, []any{1}, &balance)
	} else {
		err = w.pool.QueryRow(ctx, "SELECT balance FROM "+w.table+" WHERE (id OPERATOR(pg_catalog.=) 1)").Scan(&balance)
	}
	if err != nil {
		return false, fmt.Errorf("read: %w", err)
	}
	w.emit(demoEvent{Ev: "read", Balance: balance, Token: tok})

	if waitForGo {
		// The classic "check before write": it passes, and the pause comes after it.
		if lease.Context().Err() != nil {
			return false, errors.New("lease already lost before the pause")
		}
		w.emit(demoEvent{Ev: "ready"})
		if !w.in.Scan() {
			return false, errors.New("parent went away")
		}
	}

	newBalance := balance + w.amount
	err = w.write(ctx, tok, newBalance)
	rejected := false
	var se *pgfence.Error
	switch {
	case errors.As(err, &se) && se.Kind == pgfence.ErrStaleToken:
		rejected = true
		var fence, token int64 // the Reason says "row fence F > token T"
		_, _ = fmt.Sscanf(se.Reason, "row fence %d > token %d", &fence, &token)
		w.emit(demoEvent{Ev: "rejected", Token: tok, Fence: fence})
	case err != nil:
		return false, err
	default:
		w.emit(demoEvent{Ev: "wrote", Balance: newBalance, Token: tok})
	}
	if err := lease.Release(ctx); err != nil {
		msg := oneLine(err)
		if errors.Is(err, pgfence.ErrLost) {
			msg = "lease lost: a newer grant exists (Release is conditional on holder and token)"
		}
		w.emit(demoEvent{Ev: "release-refused", Msg: msg})
	} else {
		w.emit(demoEvent{Ev: "released"})
	}
	return rejected, nil
}

func (w *worker) write(ctx context.Context, tok int64, balance int) error {
	if !w.fenced {
		_, err := w.pool.Exec(ctx, "UPDATE "+w.table+" SET balance = $1 WHERE id OPERATOR(pg_catalog.=) 1", balance)
		return err
	}
	_, err := w.fw.Update(ctx, w.pool, tok, []any{1}, []any{balance})
	return err
}
