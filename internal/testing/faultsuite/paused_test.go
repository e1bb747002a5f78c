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
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/history"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock"
)

// Environment of a worker process (this test binary started again).
const (
	envWorker = "PGFENCE_FAULT_WORKER"
	envDSN    = "PGFENCE_FAULT_DSN"
	envLock   = "PGFENCE_FAULT_LOCK"
	envRow    = "PGFENCE_FAULT_ROW"
	envAmount = "PGFENCE_FAULT_AMOUNT"
	envTTL    = "PGFENCE_FAULT_TTL"
)

func init() {
	if os.Getenv(envWorker) != "" {
		os.Exit(workerMain())
	}
}

// workerMain is one worker: acquire the lease, fenced read of the balance,
// then, in one transaction, the fenced write of balance+amount and a ledger
// row. Random short sleeps between the steps let the parent's SIGSTOP land at
// different points. It prints one line per step on stdout.
func workerMain() int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	fail := func(err error) int { fmt.Printf("error %v\n", err); return 1 }
	row, _ := strconv.Atoi(os.Getenv(envRow))
	amount, _ := strconv.Atoi(os.Getenv(envAmount))
	ttl, _ := time.ParseDuration(os.Getenv(envTTL))
	pool, err := pgxpool.New(ctx, os.Getenv(envDSN))
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	locker, err := pglock.New(pool, &pglock.Config{Holder: fmt.Sprintf("%s/%d", os.Getenv(envWorker), os.Getpid())})
	if err != nil {
		return fail(err)
	}
	defer locker.Close()
	table, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{
		Table: "accounts", Key: []string{"id"}, Set: []string{"balance"}, Mode: fencedwrite.Reentrant,
	})
	if err != nil {
		return fail(err)
	}
	rec, err := history.FromEnv()
	if err != nil || rec == nil {
		return fail(fmt.Errorf("no history journal: %v", err))
	}
	c := rec.NewClient()
	lock, key := os.Getenv(envLock), fmt.Sprintf("accounts/%d", row)
	lease, err := c.Acquire(ctx, locker, lock, ttl, true)
	for retry := 0; errors.Is(err, pgfence.ErrSlowGrant) && retry < 5; retry++ {
		lease, err = c.Acquire(ctx, locker, lock, ttl, true) // given back on a loaded machine
	}
	if err != nil {
		return fail(err)
	}
	tok := lease.Token()
	fmt.Printf("granted %d\n", tok)
	jitter := func() { time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond) }
	jitter()
	var balance int
	if _, err := c.FencedRead(lock, tok, key, func() (string, error) {
		_, err := table.Read(ctx, pool, tok, []any{row}, &balance)
		return strconv.Itoa(balance), err
	}); err != nil {
		if errors.Is(err, pgfence.ErrStaleToken) {
			fmt.Printf("rejected read %v\n", err)
			return 0
		}
		return fail(err)
	}
	fmt.Printf("read %d\n", balance)
	jitter()
	err = c.Fenced(lock, tok, fencedwrite.Reentrant, key, strconv.Itoa(balance+amount), func() error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := table.Update(ctx, tx, tok, []any{row}, []any{balance + amount}); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "INSERT INTO ledger(account, token, worker, amount, old_balance, new_balance) VALUES ($1, $2, $3, $4, $5, $6)",
				row, tok, os.Getenv(envWorker), amount, balance, balance+amount)
			return err
		})
	})
	var fence int64
	switch {
	case staleFence(err, &fence):
		fmt.Printf("rejected write token %d fence %d\n", tok, fence)
	case err != nil:
		// Paused inside the transaction: the server ended the idle
		// transaction (idle_in_transaction_session_timeout) and nothing of it
		// was committed.
		fmt.Printf("aborted %v\n", strings.Join(strings.Fields(err.Error()), " "))
	default:
		fmt.Printf("wrote %d\n", balance+amount)
	}
	_ = c.Release(ctx, lease)
	return 0
}

type proc struct {
	cmd   *exec.Cmd
	lines chan string
	out   strings.Builder
}

func startWorker(t *testing.T, dsn, name, lock string, row, amount int, ttl time.Duration, journal string) *proc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), envWorker+"="+name, envDSN+"="+dsn, envLock+"="+lock,
		envRow+"="+strconv.Itoa(row), envAmount+"="+strconv.Itoa(amount), envTTL+"="+ttl.String(), journal)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, lines: make(chan string, 16)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
	})
	return p
}

// next returns the worker's next line, failing the test after a minute.
func (p *proc) next(t *testing.T) string {
	t.Helper()
	select {
	case l, ok := <-p.lines:
		if !ok {
			t.Fatalf("worker ended early: %s", p.out.String())
		}
		p.out.WriteString(l + "\n")
		if strings.HasPrefix(l, "error ") {
			t.Fatalf("worker: %s", l)
		}
		return l
	case <-time.After(time.Minute):
		t.Fatal("worker silent for a minute")
		return ""
	}
}

// rest drains the worker's output and waits for it to exit.
func (p *proc) rest(t *testing.T) []string {
	t.Helper()
	var out []string
	for {
		select {
		case l, ok := <-p.lines:
			if !ok {
				if err := p.cmd.Wait(); err != nil {
					t.Fatalf("worker: %v (%s)", err, strings.Join(out, "; "))
				}
				return out
			}
			if strings.HasPrefix(l, "error ") {
				t.Fatalf("worker: %s", l)
			}
			out = append(out, l)
		case <-time.After(time.Minute):
			t.Fatal("worker did not finish")
		}
	}
}

// TestPausedProcess freezes worker A (SIGSTOP) at a random point between its
// grant and its write, lets its lease run out, lets worker B take the lease
// and write, then resumes A. Every stale write must be refused with the typed
// error, and the ledger (one row per accepted write, in the same transaction)
// must show no lost or overwritten update.
func TestPausedProcess(t *testing.T) {
	t.Parallel()
	iterations := 20
	if long() {
		iterations = 200
	}
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	// A worker frozen inside its write transaction holds the row lock; the
	// server ends such a session after 1s so the next holder is not blocked
	// for as long as the pause lasts (see the README's advice on
	// idle_in_transaction_session_timeout).
	workerDSN := withParams(t, dsn, "idle_in_transaction_session_timeout", "1000")
	if _, err := pool.Exec(ctx, `
		CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL, fence bigint NOT NULL DEFAULT 0);
		CREATE TABLE ledger (id bigserial PRIMARY KEY, account int NOT NULL, token bigint NOT NULL, worker text NOT NULL,
		                     amount int NOT NULL, old_balance int NOT NULL, new_balance int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	const ttl = 300 * time.Millisecond
	const lanes = 4
	rec := history.New()
	rec.BoundCutAcquires() // processes paused; no network delay
	journals := t.TempDir()
	var staleRejected, aWroteBeforePause, aAborted atomic.Int64
	t.Run("lanes", func(t *testing.T) {
		for lane := range lanes {
			t.Run(fmt.Sprint(lane), func(t *testing.T) {
				t.Parallel()
				for i := lane; i < iterations; i += lanes {
					switch pausedIteration(t, pool, workerDSN, i, ttl, rec, journals) {
					case "rejected":
						staleRejected.Add(1)
					case "wrote":
						aWroteBeforePause.Add(1)
					case "aborted":
						aAborted.Add(1)
					}
				}
			})
		}
	})
	rec.Verify(t)
	t.Logf("paused process: %d iterations, %d stale writes rejected, %d where A wrote before the pause, "+
		"%d where A was paused inside its transaction and the server aborted it, lost updates 0",
		iterations, staleRejected.Load(), aWroteBeforePause.Load(), aAborted.Load())
	if staleRejected.Load() == 0 {
		t.Error("no stale write was ever attempted: the pause did not land between grant and write")
	}
}

// pausedIteration runs one A-paused/B-writes/A-resumes round on account i and
// checks its ledger. It returns how A's write ended: rejected, wrote (A wrote
// before the pause) or aborted (A was frozen inside its transaction).
func pausedIteration(t *testing.T, pool *pgxpool.Pool, dsn string, i int, ttl time.Duration, rec *history.Recorder, journals string) string {
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "INSERT INTO accounts VALUES ($1, 100, 0)", i); err != nil {
		t.Fatal(err)
	}
	rec.Seed(fmt.Sprintf("accounts/%d", i), "100")
	lock := fmt.Sprintf("paused:%d", i)
	ja, jb := filepath.Join(journals, fmt.Sprintf("%d-a", i)), filepath.Join(journals, fmt.Sprintf("%d-b", i))
	defer func() {
		for _, j := range []string{ja, jb} {
			if err := rec.ReadJournal(j); err != nil {
				t.Error(err)
			}
		}
	}()
	a := startWorker(t, dsn, "A", lock, i, 50, ttl, rec.JournalEnv(ja, 1000*(2*i+1)))
	if l := a.next(t); !strings.HasPrefix(l, "granted ") {
		t.Fatalf("A: %s", l)
	}
	time.Sleep(time.Duration(rand.IntN(6000)) * time.Microsecond)
	if err := a.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	b := startWorker(t, dsn, "B", lock, i, 10, ttl, rec.JournalEnv(jb, 1000*(2*i+2)))
	bOut := b.rest(t)
	if len(bOut) == 0 || !strings.HasPrefix(bOut[len(bOut)-1], "wrote ") {
		t.Fatalf("iteration %d: B did not write: %v", i, bOut)
	}
	if err := a.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	aOut := a.rest(t)
	checkLedger(t, pool, i)
	last := ""
	if len(aOut) > 0 {
		last = aOut[len(aOut)-1]
	}
	for _, outcome := range []string{"rejected", "wrote", "aborted"} {
		if strings.HasPrefix(last, outcome+" ") {
			return outcome
		}
	}
	t.Fatalf("iteration %d: A ended with %q", i, aOut)
	return ""
}

// checkLedger verifies one account: accepted writes have non-decreasing tokens
// in commit order, each started from the previous one's result (no overwritten
// update), and the balance is the start plus every accepted amount.
func checkLedger(t *testing.T, pool *pgxpool.Pool, account int) {
	t.Helper()
	ctx := context.Background()
	rows, err := pool.Query(ctx, "SELECT token, amount, old_balance, new_balance FROM ledger WHERE account = $1 ORDER BY id", account)
	if err != nil {
		t.Fatal(err)
	}
	type entry struct{ Token, Amount, Old, New int64 }
	entries, err := pgx.CollectRows(rows, pgx.RowToStructByPos[entry])
	if err != nil {
		t.Fatal(err)
	}
	balance, lastToken := int64(100), int64(0)
	for _, e := range entries {
		if e.Token < lastToken {
			t.Errorf("account %d: token %d accepted after token %d", account, e.Token, lastToken)
		}
		if e.Old != balance {
			t.Errorf("account %d: write with token %d started from %d, but the balance was %d: an update was overwritten", account, e.Token, e.Old, balance)
		}
		balance, lastToken = e.New, e.Token
	}
	var final int64
	if err := pool.QueryRow(ctx, "SELECT balance FROM accounts WHERE id = $1", account).Scan(&final); err != nil {
		t.Fatal(err)
	}
	if final != balance {
		t.Errorf("account %d: balance %d, ledger says %d", account, final, balance)
	}
}
