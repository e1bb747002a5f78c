package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/internal/testing/localpg"
	"github.com/pgfence/pgfence/migrations"
)

const (
	demoStart   = 100
	demoAmountA = 50
	demoAmountB = 10
)

func (a *app) addDemoCommands(root *cobra.Command) {
	root.AddCommand(a.demoCommand(), a.demoWorkerCommand())
}

func (a *app) demoCommand() *cobra.Command {
	var ttl time.Duration
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Show the paused-worker bug with two real processes, then the same pause with fencing",
		Long: `Runs the story of a lease lock and a paused holder twice, with two real worker
processes and a real pause (SIGSTOP/SIGCONT):

  1. without fencing: the paused worker's stale write lands and the newer update is lost;
  2. with fencing tokens: the stale write is rejected by the database and the worker
     starts over under a new grant.

With no --database-url-file, --database-url or DATABASE_URL, it starts a
throwaway PostgreSQL from the server binaries installed on this machine (initdb
and postgres on PATH or under /usr/lib/postgresql/*/bin) and removes it
afterwards. With a database it applies pgfence's migrations, works in a schema
of its own and drops it afterwards.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if ttl < 200*time.Millisecond || ttl > time.Minute {
				return usageErr("--ttl must be between 200ms and 1m")
			}
			return a.runDemo(cmd.Context(), ttl)
		},
	}
	cmd.Flags().DurationVar(&ttl, "ttl", time.Second, "lease duration the workers use")
	return cmd
}

func (a *app) runDemo(ctx context.Context, ttl time.Duration) (err error) {
	if err := pauseSupported(); err != nil {
		return err
	}
	out := a.env.Stdout
	dsn := a.dsn()
	if dsn == "" {
		fmt.Fprintln(out, "No database given: starting a throwaway PostgreSQL ...")
		cluster, err := localpg.Start(ctx, localpg.Options{Log: prefixWriter(&sync.Mutex{}, out, "  ")})
		if errors.Is(err, localpg.ErrNoBinaries) {
			return fmt.Errorf("no database given and no PostgreSQL server binaries to start a throwaway one: " +
				"set DATABASE_URL (or --database-url-file) to a database where you may create a schema, " +
				"or install the PostgreSQL server (Debian/Ubuntu: apt-get install postgresql; macOS: brew install postgresql)")
		}
		if err != nil {
			return err
		}
		defer func() {
			if serr := cluster.Stop(); serr != nil && err == nil {
				err = serr
			}
			fmt.Fprintln(out, "Stopped the throwaway PostgreSQL and removed its files.")
		}()
		dsn = cluster.DSN()
	}
	pool, err := connectDSN(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrations.UpPool(ctx, pool); err != nil {
		return err
	}
	schema := fmt.Sprintf("pgfence_demo_%d_%04d", os.Getpid(), rand.IntN(10000))
	table := pgx.Identifier{schema, "accounts"}.Sanitize()
	if _, err := pool.Exec(ctx, fmt.Sprintf(`CREATE SCHEMA %s;
		CREATE TABLE %s (id int PRIMARY KEY, balance int NOT NULL, fence bigint NOT NULL DEFAULT 0)`,
		pgx.Identifier{schema}.Sanitize(), table)); err != nil {
		return err
	}
	lockPrefix := "pgfence-demo:" + schema + ":"
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_, _ = pool.Exec(cctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		_ = deleteDemoLocks(cctx, pool, lockPrefix)
	}()

	exe, err := os.Executable()
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "\nAccount balance starts at %d. Worker A adds %d, worker B adds %d: the right answer is %d.\n",
		demoStart, demoAmountA, demoAmountB, demoStart+demoAmountA+demoAmountB)
	fmt.Fprintf(out, "Both workers take the lease (TTL %s, expiry on the database clock) before read-modify-write.\n", ttl)

	verdicts := make([]string, 0, 2)
	for i, fenced := range []bool{false, true} {
		title := "Run 1: lease lock WITHOUT fencing"
		if fenced {
			title = "Run 2: the same pause WITH fencing tokens (fenced read + fenced write)"
		}
		fmt.Fprintf(out, "\n%s\n%s\n", title, strings.Repeat("-", len(title)))
		if _, err := pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s VALUES (1, $1, 0)
			ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance, fence = 0`, table), demoStart); err != nil {
			return err
		}
		d := &demoRun{
			out: out, exe: exe, dsn: dsn, table: schema + ".accounts", fenced: fenced, ttl: ttl,
			lock: fmt.Sprintf("%saccount-1:run%d", lockPrefix, i+1), start: time.Now(),
		}
		if err := d.run(ctx); err != nil {
			return fmt.Errorf("demo run %d: %w", i+1, err)
		}
		var balance int
		var fence int64
		if err := pool.QueryRow(ctx, fmt.Sprintf("SELECT balance, fence FROM %s WHERE (id OPERATOR(pg_catalog.=) 1)", table)).Scan(&balance, &fence); err != nil {
			return err
		}
		want := demoStart + demoAmountA + demoAmountB
		var v string
		if balance == want {
			v = fmt.Sprintf("final balance %d (right answer %d): CORRECT — the stale write was rejected (%d rejected); no update lost", balance, want, d.rejected)
		} else {
			v = fmt.Sprintf("final balance %d (right answer %d): WRONG — an update was lost: the paused worker's stale write landed", balance, want)
		}
		fmt.Fprintf(out, "Verdict: %s\n", v)
		verdicts = append(verdicts, fmt.Sprintf("  run %d (%s): %s", i+1, map[bool]string{false: "no fencing", true: "fencing"}[fenced], v))
	}
	fmt.Fprintf(out, "\nSummary\n%s\n", strings.Join(verdicts, "\n"))
	fmt.Fprintln(out, "\nA lease only decides who may start; the storage must refuse the stale holder. See docs/fencedwrite.md.")
	return nil
}

// deleteDemoLocks deletes the lock rows whose name starts with prefix, the
// demo's own. Demo locks only: an application's lock rows are never
// deleted, so the prefix is compared as it is (a LIKE pattern would read
// the '_' of the schema name as "any character").
func deleteDemoLocks(ctx context.Context, pool *pgxpool.Pool, prefix string) error {
	_, err := pool.Exec(ctx, `DELETE FROM pgfence.locks
		WHERE (pg_catalog.left(name, pg_catalog.length($1::pg_catalog.text)) OPERATOR(pg_catalog.=) $1::pg_catalog.text)`, prefix)
	return err
}

type demoEvent struct {
	Who     string `json:"who"`
	Ev      string `json:"ev"`
	Token   int64  `json:"token,omitempty"`
	Balance int    `json:"balance,omitempty"`
	Fence   int64  `json:"fence,omitempty"`
	Msg     string `json:"msg,omitempty"`
}

type demoRun struct {
	out      io.Writer
	exe, dsn string
	table    string
	lock     string
	fenced   bool
	ttl      time.Duration
	start    time.Time
	rejected int

	mu sync.Mutex
}

type demoWorker struct {
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	events chan demoEvent
	done   chan error
}

func (d *demoRun) logf(who, format string, args ...any) {
	d.mu.Lock()
	defer d.mu.Unlock()
	fmt.Fprintf(d.out, "%+6.2fs  %s: %s\n", time.Since(d.start).Seconds(), who, fmt.Sprintf(format, args...))
}

// workerCommand is the command of one worker. The connection string goes
// in its environment (DATABASE_URL), never in its arguments: a command line
// is visible to every user of the machine (ps, /proc/PID/cmdline), for as
// long as worker A is paused and after; an environment only to the same
// user.
func (d *demoRun) workerCommand(ctx context.Context, name string, amount int) *exec.Cmd {
	args := []string{"demo-worker", "--name", name, "--lock", d.lock,
		"--table", d.table, "--amount", fmt.Sprint(amount), "--ttl", d.ttl.String()}
	if d.fenced {
		args = append(args, "--fenced")
	}
	cmd := exec.CommandContext(ctx, d.exe, args...)
	env := make([]string, 0, len(os.Environ())+1)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DATABASE_URL=") {
			env = append(env, kv)
		}
	}
	cmd.Env = append(env, "DATABASE_URL="+d.dsn)
	return cmd
}

func (d *demoRun) startWorker(ctx context.Context, name string, amount int) (*demoWorker, error) {
	cmd := d.workerCommand(ctx, name, amount)
	cmd.Stderr = prefixWriter(&d.mu, d.out, "        "+name+" stderr: ")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	w := &demoWorker{name: name, cmd: cmd, stdin: stdin, events: make(chan demoEvent, 16), done: make(chan error, 1)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var ev demoEvent
			if json.Unmarshal(sc.Bytes(), &ev) == nil {
				w.events <- ev
			}
		}
		close(w.events)
		w.done <- cmd.Wait()
	}()
	return w, nil
}

// until prints w's events until one named ev arrives.
func (d *demoRun) until(ctx context.Context, w *demoWorker, ev string) (demoEvent, error) {
	timeout := time.NewTimer(30 * time.Second)
	defer timeout.Stop()
	for {
		select {
		case e, ok := <-w.events:
			if !ok {
				return demoEvent{}, fmt.Errorf("worker %s ended before %q: %v", w.name, ev, <-w.done)
			}
			d.describe(w.name, e)
			if e.Ev == ev {
				return e, nil
			}
		case <-timeout.C:
			return demoEvent{}, fmt.Errorf("worker %s: no %q within 30s", w.name, ev)
		case <-ctx.Done():
			return demoEvent{}, ctx.Err()
		}
	}
}

func (d *demoRun) describe(who string, e demoEvent) {
	switch e.Ev {
	case "granted":
		d.logf(who, "got the lock, fencing token %d (lease %s)", e.Token, d.ttl)
	case "read":
		if d.fenced {
			d.logf(who, "read balance %d (fenced read: row fence raised to %d)", e.Balance, e.Token)
		} else {
			d.logf(who, "read balance %d", e.Balance)
		}
	case "ready":
		d.logf(who, "checked: lease still valid; about to write")
	case "wrote":
		d.logf(who, "wrote balance %d (token %d): accepted", e.Balance, e.Token)
	case "rejected":
		d.rejected++
		d.logf(who, "write REJECTED by the database: stale token %d, row fence is %d", e.Token, e.Fence)
	case "released":
		d.logf(who, "released the lock")
	case "release-refused":
		d.logf(who, "release refused: %s", e.Msg)
	case "exit":
		// not shown
	case "retry":
		d.logf(who, "starts over under a new grant")
	default:
		d.logf(who, "%s %s", e.Ev, e.Msg)
	}
}

func (d *demoRun) run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // kills any worker still running (exec.CommandContext)

	a, err := d.startWorker(ctx, "A", demoAmountA)
	if err != nil {
		return err
	}
	defer func() { _ = resumeProcess(a.cmd.Process) }()
	if _, err := d.until(ctx, a, "ready"); err != nil {
		return err
	}
	if err := pauseProcess(a.cmd.Process); err != nil {
		return err
	}
	d.logf("A", "PAUSED with SIGSTOP (think: GC pause, VM stall) — its lease runs out on the database clock")

	b, err := d.startWorker(ctx, "B", demoAmountB)
	if err != nil {
		return err
	}
	if _, err := d.until(ctx, b, "ready"); err != nil {
		return err
	}
	if _, err := io.WriteString(b.stdin, "go\n"); err != nil {
		return err
	}
	if _, err := d.until(ctx, b, "exit"); err != nil {
		return err
	}
	if err := <-b.done; err != nil {
		return fmt.Errorf("worker B: %w", err)
	}

	if err := resumeProcess(a.cmd.Process); err != nil {
		return err
	}
	d.logf("A", "RESUMED with SIGCONT; still believes it holds the lock and writes what it computed")
	if _, err := io.WriteString(a.stdin, "go\n"); err != nil {
		return err
	}
	if _, err := d.until(ctx, a, "exit"); err != nil {
		return err
	}
	if err := <-a.done; err != nil {
		return fmt.Errorf("worker A: %w", err)
	}
	return nil
}

// ---- the worker process ----

// prefixWriter prefixes every line written to w. Writes are serialised by mu,
// which callers share with their own writes to w.
func prefixWriter(mu *sync.Mutex, w io.Writer, prefix string) io.Writer {
	return &linePrefixer{mu: mu, w: w, prefix: prefix, atStart: true}
}

type linePrefixer struct {
	mu      *sync.Mutex
	w       io.Writer
	prefix  string
	atStart bool
}

func (p *linePrefixer) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var sb strings.Builder
	for _, c := range string(b) {
		if p.atStart {
			sb.WriteString(p.prefix)
			p.atStart = false
		}
		sb.WriteRune(c)
		if c == '\n' {
			p.atStart = true
		}
	}
	if _, err := io.WriteString(p.w, sb.String()); err != nil {
		return 0, err
	}
	return len(b), nil
}
