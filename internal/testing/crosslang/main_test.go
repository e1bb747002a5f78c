// Package crosslang runs pgfence's door from two languages at once: the
// Python example client (examples/python/pgfence.py) and Go (pglock,
// skiplocked), as real processes against one PostgreSQL, connected as the
// application role of docs/migrations.md. Holders are paused with SIGSTOP
// past their leases and claims; the tests check that every late write and
// every stale completion is refused, whatever the language of either side.
//
// The tests need python3 with psycopg 3 (Debian: apt-get install
// python3-psycopg, or make test-deps): without it they fail, never skip.
package crosslang

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// helperEnv set to "1" makes the test binary run the Go lease worker of
// goLeaseWorker with its arguments instead of the tests.
const helperEnv = "PGFENCE_CROSSLANG_HELPER"

// pythonEnv names the interpreter to use instead of looking for one.
const pythonEnv = "PGFENCE_PYTHON"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) == "1" {
		os.Exit(goLeaseWorker(os.Args[1:]))
	}
	pgtest.Main(m)
}

// pyInfo is the interpreter that imports psycopg, and the versions found.
type pyInfo struct {
	exe, version, psycopg string
}

var findPython = sync.OnceValues(func() (pyInfo, error) {
	candidates := []string{"python3", "/usr/bin/python3"} // Debian's, where python3-psycopg installs
	if p := os.Getenv(pythonEnv); p != "" {
		candidates = []string{p}
	}
	var tried []string
	for _, c := range candidates {
		out, err := exec.Command(c, "-c", "import sys, psycopg; print(sys.version.split()[0], psycopg.__version__)").CombinedOutput()
		if f := strings.Fields(string(out)); err == nil && len(f) == 2 {
			return pyInfo{exe: c, version: f[0], psycopg: f[1]}, nil
		}
		tried = append(tried, fmt.Sprintf("%s: %v %s", c, err, lastLine(out)))
	}
	return pyInfo{}, fmt.Errorf("these tests run the Python example client and need python3 with psycopg 3: "+
		"apt-get install python3-psycopg (or make test-deps); tried %s", strings.Join(tried, "; "))
})

func lastLine(b []byte) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return lines[len(lines)-1]
}

// python returns the interpreter, failing t (never skipping) without one.
func python(t *testing.T) pyInfo {
	t.Helper()
	info, err := findPython()
	if err != nil {
		t.Fatal(err)
	}
	return info
}

// clientPath is examples/python/pgfence.py.
func clientPath(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	p := filepath.Join(filepath.Dir(file), "..", "..", "..", "examples", "python", "pgfence.py")
	if _, err := os.Stat(p); err != nil {
		t.Fatal(err)
	}
	return p
}

// setup is a fresh migrated database with the owner's pool, an application
// role with docs/migrations.md's grants plus extra (with %s for the role),
// and that role's DSN.
func setup(t *testing.T, ctx context.Context, ddl, extra string) (admin *pgxpool.Pool, roleDSN string) {
	t.Helper()
	dsn := pgtest.DSN(t)
	admin = pgtest.PoolFor(t, dsn)
	if _, err := admin.Exec(ctx, ddl); err != nil {
		t.Fatal(err)
	}
	role, roleDSN := pgtest.DocRole(t, "migrations.md", dsn, "app")
	if _, err := admin.Exec(ctx, strings.ReplaceAll(extra, "%s", pgx.Identifier{role}.Sanitize())); err != nil {
		t.Fatal(err)
	}
	return admin, roleDSN
}

// withParam adds a query parameter to a URL DSN (for pgx-only settings,
// which libpq, and so the Python client, refuses).
func withParam(t *testing.T, dsn, k, v string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set(k, v)
	u.RawQuery = q.Encode()
	return u.String()
}

// roundTrip is the median of 21 round trips of a trivial query as the role.
func roundTrip(t *testing.T, ctx context.Context, pool *pgxpool.Pool) time.Duration {
	t.Helper()
	var ds []time.Duration
	for range 21 {
		start := time.Now()
		if _, err := pool.Exec(ctx, "SELECT 1"); err != nil {
			t.Fatal(err)
		}
		ds = append(ds, time.Since(start))
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	return ds[len(ds)/2]
}

// proc is a child process that speaks in lines: commands on stdin, one
// result per line on stdout. Its stdout lines are the test's signals.
type proc struct {
	t      *testing.T
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	stderr *syncBuffer
	exited chan struct{}
	err    error // of Wait, once exited is closed
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startProc starts argv with extra environment; it is killed (after a
// SIGCONT, in case it is stopped) and reaped when t ends.
func startProc(t *testing.T, name string, env []string, argv ...string) *proc {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), env...)
	p := &proc{t: t, name: name, cmd: cmd, lines: make(chan string, 100000), stderr: &syncBuffer{}, exited: make(chan struct{})}
	cmd.Stderr = p.stderr
	var err error
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
		p.err = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			_ = cmd.Process.Signal(syscall.SIGCONT)
			_ = cmd.Process.Kill()
			<-p.exited
		}
	})
	return p
}

// expect reads lines until one starts with prefix and returns it with the
// lines before it; it fails t when the process ends or timeout passes first.
func (p *proc) expect(prefix string, timeout time.Duration) (string, []string) {
	p.t.Helper()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var before []string
	for {
		select {
		case l, ok := <-p.lines:
			if !ok {
				<-p.exited
				p.t.Fatalf("%s ended (%v) before a line %q; lines %q; stderr:\n%s", p.name, p.err, prefix, before, p.stderr.String())
			}
			if strings.HasPrefix(l, prefix) {
				return l, before
			}
			before = append(before, l)
		case <-timer.C:
			p.t.Fatalf("%s: no line %q within %s; lines %q; stderr:\n%s", p.name, prefix, timeout, before, p.stderr.String())
		}
	}
}

// next is the next line.
func (p *proc) next(timeout time.Duration) string {
	p.t.Helper()
	l, _ := p.expect("", timeout)
	return l
}

func (p *proc) send(line string) {
	p.t.Helper()
	if _, err := io.WriteString(p.stdin, line+"\n"); err != nil {
		p.t.Fatalf("%s: send %q: %v", p.name, line, err)
	}
}

func (p *proc) signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("%s: %v: %v", p.name, sig, err)
	}
}

// stop sends SIGSTOP and returns once every thread of the process is
// stopped (state T in /proc): kill(2) returns before the signal is taken, and
// a thread still running could read the next command first.
func (p *proc) stop() {
	p.t.Helper()
	p.signal(syscall.SIGSTOP)
	dir := fmt.Sprintf("/proc/%d/task", p.cmd.Process.Pid)
	deadline := time.Now().Add(lineWait)
	for {
		tasks, err := os.ReadDir(dir)
		if err != nil {
			p.t.Fatalf("%s: %v", p.name, err)
		}
		stopped := 0
		for _, task := range tasks {
			b, err := os.ReadFile(filepath.Join(dir, task.Name(), "stat"))
			// The state follows the command name in parentheses, which may
			// itself hold spaces and parentheses.
			if i := bytes.LastIndexByte(b, ')'); err == nil && i >= 0 && i+2 < len(b) && (b[i+2] == 'T' || b[i+2] == 't') {
				stopped++
			}
		}
		if stopped == len(tasks) && stopped > 0 {
			return
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("%s: %d of %d threads stopped after %s", p.name, stopped, len(tasks), lineWait)
		}
		time.Sleep(time.Millisecond)
	}
}

// wait waits for the process to exit with status 0.
func (p *proc) wait(timeout time.Duration) {
	p.t.Helper()
	select {
	case <-p.exited:
	case <-time.After(timeout):
		p.t.Fatalf("%s did not exit within %s; stderr:\n%s", p.name, timeout, p.stderr.String())
	}
	if p.err != nil {
		p.t.Fatalf("%s: %v; stderr:\n%s", p.name, p.err, p.stderr.String())
	}
}

// pollUntil runs cond every 10ms until it is true, failing t after timeout.
// It waits for the database, such as a lease expiring on its clock.
func pollUntil(t *testing.T, ctx context.Context, timeout time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatalf("%s: %v", what, err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, timeout)
		}
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}
