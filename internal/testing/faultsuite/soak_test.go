package faultsuite

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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

// Environment of a soak worker process (this test binary started again).
const (
	envSoakWorker   = "PGFENCE_SOAK_WORKER" // worker name
	envSoakDSN      = "PGFENCE_SOAK_DSN"
	envSoakKeys     = "PGFENCE_SOAK_KEYS"
	envSoakDuration = "PGFENCE_SOAK_DURATION"
)

// soakTTL is the lease of one soak iteration. Pauses injected by the parent
// are sometimes longer, so some holders wake up stale.
const soakTTL = time.Second

func init() {
	if name := os.Getenv(envSoakWorker); name != "" {
		os.Exit(soakWorkerMain(name))
	}
}

// soakWorkerMain loops until its duration is over: take the lease of a random
// key, fenced read of the balance, then in one transaction the fenced write of
// balance+1 and a ledger row, then release. Any error (killed backend, server
// restart, lease lost) ends the iteration and the loop goes on. It prints
// "ack KEY TOKEN" for every commit the server acknowledged and a final
// "summary" line.
func soakWorkerMain(name string) int {
	keys, _ := strconv.Atoi(os.Getenv(envSoakKeys))
	dur, _ := time.ParseDuration(os.Getenv(envSoakDuration))
	end := time.Now().Add(dur)
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	fail := func(err error) int { fmt.Fprintf(out, "error %v\n", err); return 1 }
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv(envSoakDSN))
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	locker, err := pglock.New(pool, &pglock.Config{Holder: fmt.Sprintf("%s/%d", name, os.Getpid())})
	if err != nil {
		return fail(err)
	}
	defer locker.Close()
	var table *fencedwrite.Table
	for table == nil {
		t, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{
			Table: "soak_accounts", Key: []string{"id"}, Set: []string{"balance"}, Mode: fencedwrite.Reentrant,
		})
		if err != nil {
			if time.Now().After(end) {
				return fail(err)
			}
			time.Sleep(100 * time.Millisecond)
			continue
		}
		table = t
	}
	rec, err := history.FromEnv()
	if err != nil || rec == nil {
		return fail(fmt.Errorf("no history journal: %v", err))
	}
	c := rec.NewClient()
	var iterations, committed, stale, failed, lockedOut int
	for time.Now().Before(end) {
		iterations++
		key := rand.IntN(keys)
		switch err := soakIteration(ctx, c, pool, locker, table, name, key, out); {
		case err == nil:
			committed++
		case errors.Is(err, pgfence.ErrStaleToken):
			stale++
		case errors.Is(err, context.DeadlineExceeded):
			lockedOut++
		default:
			failed++
			time.Sleep(time.Duration(20+rand.IntN(80)) * time.Millisecond)
		}
		_ = out.Flush()
	}
	fmt.Fprintf(out, "summary iterations=%d committed=%d stale=%d failed=%d timedout=%d\n", iterations, committed, stale, failed, lockedOut)
	return 0
}

func soakIteration(ctx context.Context, c *history.Client, pool *pgxpool.Pool, locker *pglock.Locker, table *fencedwrite.Table, name string, key int, out io.Writer) error {
	actx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	lock, row := fmt.Sprintf("soak:%d", key), fmt.Sprintf("soak_accounts/%d", key)
	lease, err := c.Acquire(actx, locker, lock, soakTTL, true)
	if err != nil {
		return err
	}
	defer func() {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		_ = c.Release(rctx, lease)
	}()
	tok := lease.Token()
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var balance int64
	if _, err := c.FencedRead(lock, tok, row, func() (string, error) {
		_, err := table.Read(wctx, pool, tok, []any{key}, &balance)
		return strconv.FormatInt(balance, 10), err
	}); err != nil {
		return err
	}
	// The work between read and write: a pause often lands here.
	time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
	err = c.Fenced(lock, tok, fencedwrite.Reentrant, row, strconv.FormatInt(balance+1, 10), func() error {
		return pgx.BeginFunc(wctx, pool, func(tx pgx.Tx) error {
			if _, err := table.Update(wctx, tx, tok, []any{key}, []any{balance + 1}); err != nil {
				return err
			}
			_, err := tx.Exec(wctx, "INSERT INTO soak_ledger(account, token, worker, old_balance, new_balance) VALUES ($1, $2, $3, $4, $5)",
				key, tok, name, balance, balance+1)
			return err
		})
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "ack %d %d\n", key, tok)
	return nil
}

// soakProc is a running soak worker and what it printed.
type soakProc struct {
	cmd     *exec.Cmd
	mu      sync.Mutex
	acks    [][2]int64 // key, token
	summary string
	errors  []string
	done    chan struct{}
	paused  atomic.Bool
}

func startSoakWorker(t *testing.T, dsn, name string, keys int, dur time.Duration, journal string) *soakProc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), envSoakWorker+"="+name, envSoakDSN+"="+dsn,
		envSoakKeys+"="+strconv.Itoa(keys), envSoakDuration+"="+dur.String(), journal)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &soakProc{cmd: cmd, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			l := sc.Text()
			p.mu.Lock()
			switch {
			case strings.HasPrefix(l, "ack "):
				var k, tok int64
				if _, err := fmt.Sscanf(l, "ack %d %d", &k, &tok); err == nil {
					p.acks = append(p.acks, [2]int64{k, tok})
				}
			case strings.HasPrefix(l, "summary "):
				p.summary = l
			default:
				p.errors = append(p.errors, l)
			}
			p.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
	})
	return p
}

// TestSoak runs worker processes that increment balances under leases with
// fenced reads and writes and a ledger row per write, while the test kills
// their backends (pg_terminate_backend), freezes whole processes
// (SIGSTOP/SIGCONT, sometimes longer than the lease) and crashes and restarts
// the server once. At the end the ledger must balance: for every key the
// balance equals its number of ledger rows, tokens grow in commit order, each
// row starts from the previous row's result, and every commit a worker was
// told about is in the ledger.
func TestSoak(t *testing.T) {
	t.Parallel()
	workers, keys, dur := 4, 4, 20*time.Second
	if long() {
		workers, keys, dur = 8, 6, 3*time.Minute
	}
	ctx := context.Background()
	srv, err := pgserver.Start(ctx, pgserver.Options{NoContainers: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Stop() })
	setup, err := pgxpool.New(ctx, srv.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if err := migrations.UpPool(ctx, setup); err != nil {
		t.Fatal(err)
	}
	if _, err := setup.Exec(ctx, `
		CREATE TABLE soak_accounts (id int PRIMARY KEY, balance bigint NOT NULL, fence bigint NOT NULL DEFAULT 0);
		CREATE TABLE soak_ledger (id bigserial PRIMARY KEY, account int NOT NULL, token bigint NOT NULL, worker text NOT NULL,
		                          old_balance bigint NOT NULL, new_balance bigint NOT NULL);
		INSERT INTO soak_accounts SELECT g, 0, 0 FROM generate_series(0, `+strconv.Itoa(keys-1)+`) g`); err != nil {
		t.Fatal(err)
	}
	setup.Close()

	// A worker frozen inside its transaction would hold the row lock for the
	// whole pause; the server ends such sessions after 1s. Pauses last 0.2-2s,
	// so about half of them outlive the 1s lease.
	workerDSN := withParams(t, srv.DSN, "idle_in_transaction_session_timeout", "1000", "application_name", "pgfence-soak")
	// Every worker journals its operations; the server crash below may undo
	// the plain releases (not flushed) that returned shortly before it,
	// which the history checks allow (rec.Crashed).
	rec := history.New()
	rec.BoundCutAcquires() // kills, pauses and a crash; no network delay
	for k := range keys {
		rec.Seed(fmt.Sprintf("soak_accounts/%d", k), "0")
	}
	journals := t.TempDir()
	procs := make([]*soakProc, workers)
	for i := range procs {
		procs[i] = startSoakWorker(t, workerDSN, fmt.Sprintf("w%d", i), keys, dur, rec.JournalEnv(filepath.Join(journals, fmt.Sprint(i)), 1000*(i+1)))
	}

	// The nemesis: kills, pauses (several processes may be frozen at once),
	// one crash and restart, until shortly before the workers' end.
	var terminated, pauses, restarts, killAttempts int
	var pausing sync.WaitGroup
	start := time.Now()
	restartAt := dur * 2 / 5
	admin, err := pgx.Connect(ctx, srv.DSN)
	if err != nil {
		t.Fatal(err)
	}
	for time.Since(start) < dur-2*time.Second {
		switch {
		case restarts == 0 && time.Since(start) > restartAt:
			admin.Close(ctx)
			rec.Crashed()
			if err := srv.Kill(syscall.SIGQUIT); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Duration(200+rand.IntN(500)) * time.Millisecond)
			if err := srv.Restart(ctx); err != nil {
				t.Fatal(err)
			}
			restarts++
			if admin, err = pgx.Connect(ctx, srv.DSN); err != nil {
				t.Fatal(err)
			}
		case rand.IntN(5) < 2:
			killAttempts++
			var n int
			if err := admin.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM (
				SELECT pid FROM pg_stat_activity WHERE application_name = 'pgfence-soak' ORDER BY random() LIMIT 1) s`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			terminated += n
		default:
			p := procs[rand.IntN(len(procs))]
			if !p.paused.CompareAndSwap(false, true) {
				break
			}
			if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			pauses++
			pausing.Add(1)
			go func() {
				defer pausing.Done()
				time.Sleep(time.Duration(200+rand.IntN(1800)) * time.Millisecond)
				_ = p.cmd.Process.Signal(syscall.SIGCONT)
				p.paused.Store(false)
			}()
		}
		time.Sleep(time.Duration(100+rand.IntN(300)) * time.Millisecond)
	}
	// On a starved machine the workers may have had no session open at any
	// of the random attempts: keep trying while they still run, so that the
	// soak does exercise a termination.
	for terminated == 0 && time.Since(start) < dur-500*time.Millisecond {
		killAttempts++
		var n int
		if err := admin.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM (
			SELECT pid FROM pg_stat_activity WHERE application_name = 'pgfence-soak' ORDER BY random() LIMIT 1) s`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		terminated += n
		time.Sleep(20 * time.Millisecond)
	}
	admin.Close(ctx)
	pausing.Wait()

	var iterations, committed, stale, failed, timedout, acks int
	for i, p := range procs {
		select {
		case <-p.done:
		case <-time.After(dur + time.Minute):
			t.Fatalf("worker %d did not finish", i)
		}
		if err := p.cmd.Wait(); err != nil {
			t.Fatalf("worker %d: %v %v", i, err, p.errors)
		}
		if len(p.errors) > 0 || p.summary == "" {
			t.Fatalf("worker %d: no summary, output %v", i, p.errors)
		}
		f := fields(p.summary)
		n := func(k string) int { v, _ := strconv.Atoi(f[k]); return v }
		iterations += n("iterations")
		committed += n("committed")
		stale += n("stale")
		failed += n("failed")
		timedout += n("timedout")
		acks += len(p.acks)
	}
	for i := range procs {
		if err := rec.ReadJournal(filepath.Join(journals, fmt.Sprint(i))); err != nil {
			t.Fatal(err)
		}
	}
	rec.Verify(t)

	check := bigPool(t, srv.DSN, 4)
	lost, rows := 0, 0
	ledger := map[[2]int64]bool{}
	for key := range keys {
		r, err := check.Query(ctx, "SELECT token, old_balance, new_balance FROM soak_ledger WHERE account = $1 ORDER BY id", key)
		if err != nil {
			t.Fatal(err)
		}
		type entry struct{ Token, Old, New int64 }
		entries, err := pgx.CollectRows(r, pgx.RowToStructByPos[entry])
		if err != nil {
			t.Fatal(err)
		}
		balance, lastToken := int64(0), int64(0)
		for _, e := range entries {
			ledger[[2]int64{int64(key), e.Token}] = true
			if e.Token <= lastToken {
				t.Errorf("key %d: token %d committed after token %d", key, e.Token, lastToken)
			}
			if e.Old != balance {
				lost++
				t.Errorf("key %d: write with token %d started from %d, but the balance was %d: an update was lost", key, e.Token, e.Old, balance)
			}
			balance, lastToken = e.New, e.Token
		}
		rows += len(entries)
		var final int64
		if err := check.QueryRow(ctx, "SELECT balance FROM soak_accounts WHERE id = $1", key).Scan(&final); err != nil {
			t.Fatal(err)
		}
		if final != int64(len(entries)) || final != balance {
			lost++
			t.Errorf("key %d: balance %d, %d ledger rows, ledger ends at %d", key, final, len(entries), balance)
		}
	}
	missing := 0
	for _, p := range procs {
		for _, a := range p.acks {
			if !ledger[a] {
				missing++
			}
		}
	}
	if missing > 0 {
		t.Errorf("%d acknowledged commits are not in the ledger", missing)
	}
	t.Logf("soak: %d workers × %d keys × %s: %d iterations, %d commits acknowledged, %d ledger rows; faults: %d backends terminated "+
		"(%d attempts), %d process pauses, %d server crash+restart; %d stale reads/writes rejected, %d iterations failed on a fault, "+
		"%d gave up waiting for a lease; lost updates %d, acknowledged commits missing %d",
		workers, keys, dur, iterations, acks, rows, terminated, killAttempts, pauses, restarts, stale, failed, timedout, lost, missing)
	if committed != acks {
		t.Errorf("workers counted %d commits but printed %d", committed, acks)
	}
	if acks == 0 || restarts != 1 || pauses == 0 || terminated == 0 {
		t.Errorf("the soak did not exercise everything: %d commits, %d restarts, %d pauses, %d terminations", acks, restarts, pauses, terminated)
	}
}
