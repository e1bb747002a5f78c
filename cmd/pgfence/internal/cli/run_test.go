//go:build linux

package cli

// Tests of `pgfence run`'s process handling with real processes: the
// pgfence binary (built once per test binary), shells, sleeps, and a
// real PostgreSQL. Processes of a test's tree are found by a marker: a
// number unique to the test, used as the sleeps' duration, so it is in the
// command line of every process of the tree (the supervisor's and the
// shell's too, which carry the script).

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// pgfenceBin builds cmd/pgfence once per test binary. The binary goes to a
// fixed place under the temporary directory (built next to it and renamed
// into place, so concurrent test binaries do not see half a file), so runs
// do not pile up copies.
func pgfenceBin(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		_, file, _, ok := runtime.Caller(0)
		if !ok {
			binErr = fmt.Errorf("runtime.Caller failed")
			return
		}
		root := filepath.Join(filepath.Dir(file), "..", "..") // cmd/pgfence
		// A directory of this test process's own: two test processes (two
		// checkouts, or go test -count run beside another) must never run
		// each other's binary. Directories of processes that are gone are
		// removed first (the test binary has no hook at its exit here).
		prefix := fmt.Sprintf("pgfence-cli-test-%d-", os.Getuid())
		stale, _ := filepath.Glob(filepath.Join(os.TempDir(), prefix+"*"))
		for _, d := range stale {
			pid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), prefix))
			if err != nil || pid == os.Getpid() {
				continue
			}
			if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); errors.Is(err, fs.ErrNotExist) {
				_ = os.RemoveAll(d)
			}
		}
		dir := filepath.Join(os.TempDir(), fmt.Sprintf("%s%d", prefix, os.Getpid()))
		if binErr = os.MkdirAll(dir, 0o700); binErr != nil {
			return
		}
		tmp := filepath.Join(dir, "pgfence.tmp")
		cmd := exec.Command("go", "build", "-o", tmp, ".")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
			return
		}
		binPath = filepath.Join(dir, "pgfence")
		binErr = os.Rename(tmp, binPath)
	})
	if binErr != nil {
		t.Fatalf("build pgfence: %v", binErr)
	}
	return binPath
}

// newMarker returns a number of seconds unique to this test: `sleep MARKER`
// sleeps for more than a day and is easy to find in /proc.
func newMarker() string { return strconv.Itoa(100000 + rand.IntN(800000)) }

// markerProcs returns the live (non-zombie) processes whose command line
// contains marker.
func markerProcs(marker string) []string {
	var found []string
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		cmdline, err := os.ReadFile(d + "/cmdline")
		if err != nil || !strings.Contains(string(cmdline), marker) {
			continue
		}
		stat, err := os.ReadFile(d + "/stat")
		if err != nil {
			continue
		}
		if i := strings.LastIndexByte(string(stat), ')'); i >= 0 && strings.HasPrefix(string(stat[i+1:]), " Z") {
			continue
		}
		found = append(found, filepath.Base(d)+" "+strings.ReplaceAll(strings.TrimSpace(string(cmdline)), "\x00", " "))
	}
	return found
}

// killMarker SIGKILLs what is left of a test's tree (cleanup after a failure).
func killMarker(marker string) {
	for _, p := range markerProcs(marker) {
		pid, _ := strconv.Atoi(strings.Fields(p)[0])
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

type stampedLine struct {
	at   time.Time
	text string
}

// pgfenceProc is a pgfence process whose stdout and stderr are pipes read
// line by line (its stdout is inherited by the command and every process the
// command starts).
type pgfenceProc struct {
	cmd    *exec.Cmd
	out    chan stampedLine // closed at EOF
	errs   chan stampedLine // closed at EOF
	outEOF chan time.Time   // when stdout reached EOF (nobody holds it any more)
	exited chan struct{}
	exitAt time.Time
	state  *os.ProcessState

	mu     sync.Mutex
	stderr strings.Builder
	stdout strings.Builder
}

// testEnv is the environment of a pgfence process: this process's minus the
// connection variables, plus DATABASE_URL=dsn and extra.
func testEnv(dsn string, extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if k == "DATABASE_URL" || strings.HasPrefix(k, "PG") {
			continue
		}
		env = append(env, kv)
	}
	return append(append(env, "DATABASE_URL="+dsn), extra...)
}

func startPgfence(t *testing.T, env []string, marker string, args ...string) *pgfenceProc {
	t.Helper()
	outR, outW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(pgfenceBin(t), args...)
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = outW, errW // *os.File: inherited as they are
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	outW.Close()
	errW.Close()
	p := &pgfenceProc{cmd: cmd, out: make(chan stampedLine, 100), errs: make(chan stampedLine, 100), outEOF: make(chan time.Time, 1), exited: make(chan struct{})}
	read := func(r *os.File, ch chan stampedLine, b *strings.Builder, eof chan time.Time) {
		defer close(ch)
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			l := stampedLine{time.Now(), sc.Text()}
			p.mu.Lock()
			b.WriteString(l.text + "\n")
			p.mu.Unlock()
			select {
			case ch <- l:
			default: // nobody waits for this line
			}
		}
		if eof != nil {
			eof <- time.Now()
		}
	}
	go read(outR, p.out, &p.stdout, p.outEOF)
	go read(errR, p.errs, &p.stderr, nil)
	go func() {
		_ = cmd.Wait()
		p.exitAt, p.state = time.Now(), cmd.ProcessState
		close(p.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.exited
		killMarker(marker)
		// Unblock the readers if something still holds the pipes.
		outR.Close()
		errR.Close()
		if t.Failed() {
			t.Logf("pgfence stdout:\n%s\npgfence stderr:\n%s", p.text(&p.stdout), p.text(&p.stderr))
		}
	})
	return p
}

func (p *pgfenceProc) text(b *strings.Builder) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return b.String()
}

// waitLine waits for a line containing s on ch.
func waitLine(t *testing.T, p *pgfenceProc, ch <-chan stampedLine, s string, timeout time.Duration) stampedLine {
	t.Helper()
	l, found, eof := findLine(ch, s, timeout)
	switch {
	case found:
		return l
	case eof:
		t.Fatalf("no line with %q before EOF", s)
	default:
		t.Fatalf("no line with %q within %v", s, timeout)
	}
	return l
}

// findLine reads ch until a line containing s (found), EOF (eof) or timeout.
func findLine(ch <-chan stampedLine, s string, timeout time.Duration) (l stampedLine, found, eof bool) {
	deadline := time.After(timeout)
	for {
		select {
		case l, ok := <-ch:
			if !ok {
				return l, false, true
			}
			if strings.Contains(l.text, s) {
				return l, true, false
			}
		case <-deadline:
			return stampedLine{}, false, false
		}
	}
}

func (p *pgfenceProc) wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-p.exited:
		return p.state.ExitCode()
	case <-time.After(timeout):
		t.Fatalf("pgfence did not exit within %v", timeout)
		return 0
	}
}

// treeScript starts, in the background, a sleep in the command's process
// group, a sleep in a session of its own (setsid) and a sleep whose parent
// exits at once (an orphan), each holding the command's stdout, then says
// "ready" and waits.
func treeScript(marker, prefix string) string {
	return prefix + `
sleep ` + marker + ` &
setsid sleep ` + marker + ` &
( sleep ` + marker + ` & )
echo ready
wait`
}

// waitTree waits until the tree's processes are all there: the supervisor,
// the shell and the three sleeps.
func waitTree(t *testing.T, marker string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ps := markerProcs(marker)
		sleeps := 0
		for _, p := range ps {
			if strings.Contains(p, " sleep "+marker) && !strings.Contains(p, "sh -c") && !strings.Contains(p, superviseArg) {
				sleeps++
			}
		}
		if sleeps >= 3 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("tree did not start: %q", ps)
		}
		time.Sleep(10 * time.Millisecond) // polling /proc: no signal exists for "exec happened"
	}
}

// TestRunLeaseLostKillsWholeTree steals the lease of a running command whose
// tree ignores SIGTERM and holds pgfence's stdout, with processes outside the
// command's process group: the whole tree must be SIGKILLed after --grace and
// pgfence must exit 76 within grace + 1 s of reporting the loss.
func TestRunLeaseLostKillsWholeTree(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	marker := newMarker()
	const grace = time.Second
	p := startPgfence(t, testEnv(dsn), marker, "run", "--lock", "stolen-tree", "--ttl", "2s", "--grace", grace.String(), "--holder", "runner",
		"--", "sh", "-c", treeScript(marker, `trap "" TERM`))
	waitLine(t, p, p.out, "ready", 30*time.Second)
	waitTree(t, marker)

	stealAt := time.Now()
	if _, err := pool.Exec(ctx, `UPDATE pgfence.locks SET holder = 'thief', token = token + 1, expires_at = now() + interval '1 hour' WHERE name = 'stolen-tree'`); err != nil {
		t.Fatal(err)
	}
	lost := waitLine(t, p, p.errs, `lease on "stolen-tree" lost (`, 30*time.Second)
	code := p.wait(t, grace+30*time.Second)
	left := markerProcs(marker)
	exitAfter := p.exitAt.Sub(lost.at)
	var eofAfter time.Duration
	select {
	case at := <-p.outEOF:
		eofAfter = at.Sub(lost.at)
	case <-time.After(grace + 30*time.Second):
		t.Fatal("pgfence's stdout still held open after it exited")
	}
	t.Logf("steal -> loss reported %v; loss -> pgfence exit %v; loss -> stdout EOF %v (grace %v)",
		lost.at.Sub(stealAt).Round(time.Millisecond), exitAfter.Round(time.Millisecond), eofAfter.Round(time.Millisecond), grace)

	if code != ExitLeaseLost {
		t.Errorf("exit code %d, want %d", code, ExitLeaseLost)
	}
	if len(left) > 0 {
		t.Errorf("processes left when pgfence exited: %q", left)
	}
	if exitAfter > grace+time.Second {
		t.Errorf("pgfence exited %v after reporting the loss, want <= grace + 1s = %v", exitAfter, grace+time.Second)
	}
	if stealAt.After(lost.at) {
		t.Errorf("loss reported before the steal")
	}
	if exitAfter < grace*9/10 {
		t.Errorf("pgfence exited %v after the loss, before the grace period: was SIGKILL sent early?", exitAfter)
	}
	if eofAfter > grace+time.Second {
		t.Errorf("stdout reached EOF %v after the loss, want <= %v", eofAfter, grace+time.Second)
	}
	if v := lockState(t, dsn, "stolen-tree"); v.Token != 2 || v.Holder == nil || *v.Holder != "thief" {
		t.Errorf("the thief's grant was disturbed: %+v", v)
	}
}

// TestRunKill9KillsTree SIGKILLs pgfence itself: the supervisor must take the
// whole tree down at once, and the lease, no longer renewed, must expire
// within its TTL.
func TestRunKill9KillsTree(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	marker := newMarker()
	p := startPgfence(t, testEnv(dsn), marker, "run", "--lock", "k9", "--ttl", "5s", "--holder", "runner",
		"--", "sh", "-c", treeScript(marker, ""))
	waitLine(t, p, p.out, "ready", 30*time.Second)
	waitTree(t, marker)

	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killAt := time.Now()
	<-p.exited
	var left []string
	for deadline := killAt.Add(20 * time.Second); ; {
		if left = markerProcs(marker); len(left) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond) // polling /proc for the end of processes that are not ours
	}
	goneAfter := time.Since(killAt)
	t.Logf("kill -9 pgfence -> whole tree gone: %v", goneAfter.Round(time.Millisecond))
	if len(left) > 0 {
		t.Fatalf("processes survive pgfence's SIGKILL: %q", left)
	}
	if goneAfter > 2*time.Second {
		t.Errorf("tree gone %v after pgfence's SIGKILL, want <= 2s", goneAfter)
	}
	var holder string
	var token int64
	var withinTTL bool
	if err := pool.QueryRow(ctx, `SELECT holder, token, expires_at <= now() + interval '5 seconds' FROM pgfence.locks WHERE name = 'k9'`).Scan(&holder, &token, &withinTTL); err != nil {
		t.Fatal(err)
	}
	if holder != "runner" || token != 1 || !withinTTL {
		t.Errorf("lock row after kill: holder %q token %d expires within TTL %v", holder, token, withinTTL)
	}
}

// TestRunSignalStopsTree sends each of SIGHUP, SIGTERM, SIGINT and SIGQUIT
// to pgfence: the tree must be stopped, pgfence must exit 128+signal once it
// is gone, and the lease must be released.
func TestRunSignalStopsTree(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	for _, sig := range []syscall.Signal{syscall.SIGHUP, syscall.SIGTERM, syscall.SIGINT, syscall.SIGQUIT} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			if signal.Ignored(sig) {
				// pgfence keeps a signal it inherited ignored (nohup): there
				// is nothing to test with this one.
				t.Skipf("%v is ignored in this process (started under nohup?); pgfence keeps an inherited ignore by design", sig)
			}
			marker := newMarker()
			lock := "sig-" + strconv.Itoa(int(sig))
			p := startPgfence(t, testEnv(dsn), marker, "run", "--lock", lock, "--ttl", "10s", "--grace", "10s",
				"--", "sh", "-c", treeScript(marker, ""))
			waitLine(t, p, p.out, "ready", 30*time.Second)
			waitTree(t, marker)
			sentAt := time.Now()
			if err := p.cmd.Process.Signal(sig); err != nil {
				t.Fatal(err)
			}
			code := p.wait(t, 30*time.Second)
			left := markerProcs(marker)
			t.Logf("%v -> pgfence exit %v", sig, p.exitAt.Sub(sentAt).Round(time.Millisecond))
			if code != 128+int(sig) {
				t.Errorf("exit code %d, want %d", code, 128+int(sig))
			}
			if len(left) > 0 {
				t.Errorf("processes left when pgfence exited: %q", left)
			}
			if v := lockState(t, dsn, lock); v.State != "free" || v.Token != 1 {
				t.Errorf("lease not released: %+v", v)
			}
		})
	}
}

// TestRunSecondSignalKills: a tree that ignores SIGTERM, a long grace; a
// second SIGTERM sends SIGKILL at once.
func TestRunSecondSignalKills(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	marker := newMarker()
	p := startPgfence(t, testEnv(dsn), marker, "run", "--lock", "twice", "--grace", "5m",
		"--", "sh", "-c", treeScript(marker, `trap "" TERM`))
	waitLine(t, p, p.out, "ready", 30*time.Second)
	waitTree(t, marker)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitLine(t, p, p.errs, "got terminated;", 30*time.Second)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t, 30*time.Second); code != 128+int(syscall.SIGTERM) {
		t.Errorf("exit code %d, want %d", code, 128+int(syscall.SIGTERM))
	}
	if left := markerProcs(marker); len(left) > 0 {
		t.Errorf("processes left when pgfence exited: %q", left)
	}
	if v := lockState(t, dsn, "twice"); v.State != "free" {
		t.Errorf("lease not released: %+v", v)
	}
}

// procState returns the state letter of /proc/PID/stat ("" if pid is gone).
func procState(pid int) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return ""
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 || len(b) < i+3 {
		return ""
	}
	return string(b[i+2])
}

// waitState polls until every pid is in state want ("T" stopped, "S" or "R"
// running when want is "running").
func waitState(t *testing.T, want string, pids ...int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ok := true
		for _, pid := range pids {
			st := procState(pid)
			if want == "running" && (st == "T" || st == "t" || st == "") || want != "running" && st != want {
				ok = false
			}
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			var got []string
			for _, pid := range pids {
				got = append(got, fmt.Sprintf("%d:%s", pid, procState(pid)))
			}
			t.Fatalf("processes not %s: %v", want, got)
		}
		time.Sleep(5 * time.Millisecond) // polling /proc: a stop sends us no signal
	}
}

// TestRunJobControl: Ctrl-Z (SIGTSTP to pgfence) stops the command's group
// and pgfence; SIGCONT continues both.
func TestRunJobControl(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	marker := newMarker()
	p := startPgfence(t, testEnv(dsn), marker, "run", "--lock", "jobctl",
		"--", "sh", "-c", "sleep "+marker+" & echo ready; wait")
	started := waitLine(t, p, p.errs, "started sh (pid ", 30*time.Second)
	waitLine(t, p, p.out, "ready", 30*time.Second)
	cpid, err := strconv.Atoi(strings.TrimSuffix(started.text[strings.LastIndex(started.text, " ")+1:], ")"))
	if err != nil {
		t.Fatalf("pid in %q: %v", started.text, err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGTSTP); err != nil {
		t.Fatal(err)
	}
	waitState(t, "T", p.cmd.Process.Pid, cpid)
	if err := p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	waitState(t, "running", p.cmd.Process.Pid, cpid)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t, 30*time.Second); code != 128+int(syscall.SIGTERM) {
		t.Errorf("exit code %d, want %d", code, 128+int(syscall.SIGTERM))
	}
	if left := markerProcs(marker); len(left) > 0 {
		t.Errorf("processes left when pgfence exited: %q", left)
	}
}

// TestRunSupervisorKilled SIGKILLs the supervisor: the command dies with it
// (parent-death signal), pgfence kills what is left of the command's process
// group, exits 1 and does not release the lease (it cannot know that nothing
// runs any more); the lease expires on its own.
func TestRunSupervisorKilled(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	marker := newMarker()
	p := startPgfence(t, testEnv(dsn), marker, "run", "--lock", "sup", "--ttl", "10s", "--holder", "runner",
		"--", "sh", "-c", "sleep "+marker+" & echo ready; wait")
	waitLine(t, p, p.out, "ready", 30*time.Second)
	sup := 0
	for _, ps := range markerProcs(marker) {
		if strings.Contains(ps, superviseArg) {
			sup, _ = strconv.Atoi(strings.Fields(ps)[0])
		}
	}
	if sup == 0 {
		t.Fatalf("no supervisor among %q", markerProcs(marker))
	}
	if err := syscall.Kill(sup, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t, 30*time.Second); code != ExitError {
		t.Errorf("exit code %d, want %d", code, ExitError)
	}
	if left := markerProcs(marker); len(left) > 0 {
		t.Errorf("processes left when pgfence exited: %q", left)
	}
	// Read from the stderr pipe, which can lag the exit (the text gathered
	// so far may not have the last lines yet).
	if _, found, _ := findLine(p.errs, "not releasing", 30*time.Second); !found {
		t.Errorf("stderr does not say the lease is left to expire")
	}
	if v := lockState(t, dsn, "sup"); v.State != "held" || v.Holder == nil || *v.Holder != "runner" {
		t.Errorf("lease released although the tree's end is unknown: %+v", v)
	}
}

// TestRunEnvSecrets: the command gets no DATABASE_URL, PGPASSWORD or
// PGSSLPASSWORD unless --pass-env.
func TestRunEnvSecrets(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	u, err := url.Parse(dsn)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Fatalf("test DSN is not a URL: %v", err)
	}
	secret, ok := u.User.Password()
	if !ok {
		// The test server trusts local connections: a password in the URL
		// is not checked, but it is there for the command to leak.
		secret = "url-secret-" + newMarker()
		u.User = url.UserPassword(u.User.Username(), secret)
	}
	env := testEnv(u.String(), "PGPASSWORD=pg-secret-"+newMarker(), "PGSSLPASSWORD=ssl-secret-"+newMarker(), "PGAPPNAME=kept")
	for _, tc := range []struct {
		args []string
		pass bool
	}{
		{[]string{"run", "--lock", "env"}, false},
		{[]string{"run", "--lock", "env", "--pass-env"}, true},
	} {
		cmd := exec.Command(pgfenceBin(t), append(tc.args, "--", "sh", "-c", "env")...)
		cmd.Env = env
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		s := string(out)
		for _, k := range []string{"DATABASE_URL=", "PGPASSWORD=pg-secret-", "PGSSLPASSWORD=ssl-secret-", secret} {
			if strings.Contains(s, k) != tc.pass {
				t.Errorf("%v: %q in the command's environment: %v, want %v", tc.args, k, !tc.pass, tc.pass)
			}
		}
		for _, k := range []string{"PGAPPNAME=kept", "PGFENCE_TOKEN=", "PGFENCE_LOCK=env", "PGFENCE_HOLDER="} {
			if !strings.Contains(s, k) {
				t.Errorf("%v: %q missing from the command's environment", tc.args, k)
			}
		}
	}
}

// TestDatabaseURLFile: --database-url-file reads the connection string from a
// file; bad uses are usage errors.
func TestDatabaseURLFile(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	dir := t.TempDir()
	f := filepath.Join(dir, "url")
	if err := os.WriteFile(f, []byte("\n  "+dsn+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, []byte(" \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if r := run(t, "", "--database-url-file", f, "run", "--lock", "file", "--", "true"); r.code != 0 {
		t.Fatalf("run with --database-url-file: %+v", r)
	}
	if v := lockState(t, dsn, "file"); v.Token != 1 {
		t.Fatalf("lock row: %+v", v)
	}
	for _, args := range [][]string{
		{"--database-url-file", f, "--database-url", dsn, "locks"},
		{"--database-url-file", empty, "locks"},
		{"--database-url-file", filepath.Join(dir, "missing"), "locks"},
	} {
		if r := run(t, "", args...); r.code != ExitUsage {
			t.Errorf("%v: code %d, want %d (%s)", args, r.code, ExitUsage, r.stderr)
		}
	}
}

// TestRunCommandNotFound: a command that is not found or not executable,
// or a script whose #! interpreter is not, exits 127 or 126 before any
// lease is taken.
func TestRunCommandNotFound(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	dir := t.TempDir()
	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, []byte("echo hi\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Scripts, executable, whose #! line names an interpreter that the
	// kernel would not find (127) or could not execute (126).
	script := func(name, content string) string {
		t.Helper()
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	missing := filepath.Join(dir, "missing")
	badInterp := script("bad-interp", "#!"+missing+" -e\necho hi\n")
	noNewline := script("no-newline", "#!  "+missing)
	longLine := script("long-line", "#!"+missing+" "+strings.Repeat("a", 300)+"\necho hi\n")
	crlf := script("crlf", "#!/bin/sh\r\necho hi\r\n")
	relative := script("relative", "#!pgfence-no-such-interpreter-"+newMarker()+"\necho hi\n")
	interpNotExec := script("interp-not-exec", "#!"+plain+"\necho hi\n")
	interpDir := script("interp-dir", "#! "+dir+"\necho hi\n")
	if _, err := pool.Exec(ctx, "INSERT INTO pgfence.locks(name, token) VALUES ('old', 5)"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		lock, command string
		code          int
		say           string // in the message, when not ""
	}{
		{"empty", "", ExitCommandNotFound, ""},
		{"missing", filepath.Join(dir, "missing"), ExitCommandNotFound, ""},
		{"missing-path", "pgfence-no-such-command-" + newMarker(), ExitCommandNotFound, ""},
		{"old", "", ExitCommandNotFound, ""},
		{"not-executable", plain, ExitCannotExecute, ""},
		{"directory", dir, ExitCannotExecute, ""},
		{"bad-interp", badInterp, ExitCommandNotFound, "bad interpreter"},
		{"no-newline", noNewline, ExitCommandNotFound, "bad interpreter"},
		{"long-line", longLine, ExitCommandNotFound, "bad interpreter"},
		{"crlf", crlf, ExitCommandNotFound, `"/bin/sh\r" (the script has CRLF line endings)`},
		{"relative", relative, ExitCommandNotFound, "(relative to the current directory)"},
		{"interp-not-exec", interpNotExec, ExitCannotExecute, "bad interpreter"},
		{"interp-dir", interpDir, ExitCannotExecute, "bad interpreter"},
	} {
		r := run(t, dsn, "run", "--lock", tc.lock, "--", tc.command)
		if r.code != tc.code || !strings.Contains(r.stderr, tc.say) {
			t.Errorf("%q: code %d, want %d; stderr %q, want it to say %q", tc.command, r.code, tc.code, r.stderr, tc.say)
		}
	}
	var names []string
	var oldToken int64
	if err := pool.QueryRow(ctx, "SELECT coalesce(array_agg(name ORDER BY name), '{}'), max(token) FILTER (WHERE name = 'old') FROM pgfence.locks").Scan(&names, &oldToken); err != nil {
		t.Fatal(err)
	}
	if len(names) != 1 || oldToken != 5 {
		t.Errorf("lock rows after refused commands: %q, token of 'old' %d (want only 'old', token 5)", names, oldToken)
	}
}

// TestRunScriptInterpreter: a script's #! interpreter is checked where the
// kernel looks for it: after leading spaces, up to the first space, and a
// relative one against the current directory (not the script's, not PATH).
// The scripts the kernel runs run; the others are refused before any lease
// is taken.
func TestRunScriptInterpreter(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/bin/sh", filepath.Join(bin, "interp")); err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{
		"rel":    "#!bin/interp\necho rel-ran\n",
		"bare":   "#!interp\necho bare-ran\n",
		"spaced": "#! \t/bin/sh -e\necho spaced-ran\n",
		"short":  "#!/bin/sh",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// bin is in PATH: the kernel does not look there, nor may the check.
	env := testEnv(dsn, "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	for _, tc := range []struct {
		lock, cwd, command string
		code               int
		out                string
	}{
		{"rel", dir, "./rel", 0, "rel-ran\n"},
		{"rel-elsewhere", bin, "../rel", ExitCommandNotFound, ""},
		{"bare", bin, "../bare", 0, "bare-ran\n"},
		{"bare-in-path", dir, "./bare", ExitCommandNotFound, ""},
		{"spaced", dir, "./spaced", 0, "spaced-ran\n"},
		{"short", dir, "./short", 0, ""},
	} {
		var stderr strings.Builder
		cmd := exec.Command(pgfenceBin(t), "run", "--lock", tc.lock, "--", tc.command)
		cmd.Dir, cmd.Env, cmd.Stderr = tc.cwd, env, &stderr
		out, err := cmd.Output()
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatalf("%s: %v", tc.lock, err)
		}
		if code := cmd.ProcessState.ExitCode(); code != tc.code || string(out) != tc.out {
			t.Errorf("%s: %s in %s: exit %d, stdout %q; want %d, %q (stderr %q)", tc.lock, tc.command, tc.cwd, code, out, tc.code, tc.out, stderr.String())
		}
	}
	var names []string
	if err := pool.QueryRow(context.Background(), "SELECT coalesce(array_agg(name ORDER BY name), '{}') FROM pgfence.locks").Scan(&names); err != nil {
		t.Fatal(err)
	}
	if want := []string{"bare", "rel", "short", "spaced"}; strings.Join(names, " ") != strings.Join(want, " ") {
		t.Errorf("locks taken: %q, want %q (a refused script takes none)", names, want)
	}
}

// TestRunGraceBounds: a --grace that is not more than 0 and at most a day
// is a usage error before any lease is taken (a huge one overflowed
// grace+supervisorSlack: the supervisor was killed at once on a stop, and the
// lease was left held); a day is accepted.
func TestRunGraceBounds(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	for _, grace := range []string{"0s", "-1s", "2562047h", "2562047h47m16.854775807s", (maxGrace + time.Nanosecond).String()} {
		d, err := time.ParseDuration(grace)
		if err != nil {
			t.Fatal(err)
		}
		r := run(t, dsn, "run", "--lock", "grace-refused", "--grace", grace, "--", "true")
		if r.code != ExitUsage || !strings.Contains(r.stderr, "--grace "+d.String()+": must be more than 0 and at most 24h0m0s") {
			t.Errorf("--grace %s: %+v; want exit %d and the bounds", grace, r, ExitUsage)
		}
	}
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM pgfence.locks WHERE name = 'grace-refused'").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("a refused --grace took a lease")
	}
	if r := run(t, dsn, "run", "--lock", "grace-max", "--grace", maxGrace.String(), "--", "true"); r.code != 0 {
		t.Errorf("--grace %v: %+v", maxGrace, r)
	}
	if v := lockState(t, dsn, "grace-max"); v.State != "free" || v.Token != 1 {
		t.Errorf("after --grace %v: %+v", maxGrace, v)
	}
	// The longest grace on the stop path: the tree gets SIGTERM, and the
	// lease is released once it is gone.
	marker := newMarker()
	p := startPgfence(t, testEnv(dsn), marker, "run", "--lock", "grace-max", "--grace", maxGrace.String(),
		"--", "sh", "-c", "sleep "+marker+" & echo ready; wait")
	waitLine(t, p, p.out, "ready", 30*time.Second)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t, 30*time.Second); code != 128+int(syscall.SIGTERM) {
		t.Errorf("--grace %v, SIGTERM: exit %d, want %d", maxGrace, code, 128+int(syscall.SIGTERM))
	}
	if left := markerProcs(marker); len(left) > 0 {
		t.Errorf("processes left when pgfence exited: %q", left)
	}
	if v := lockState(t, dsn, "grace-max"); v.State != "free" || v.Token != 2 {
		t.Errorf("after --grace %v and SIGTERM: %+v", maxGrace, v)
	}
}

// TestRunStatusAndLeftovers: the command's exit status and killing signal
// pass through the supervisor; processes the command leaves behind are
// stopped before pgfence exits.
func TestRunStatusAndLeftovers(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	r := run(t, dsn, "run", "--lock", "st", "--", "sh", "-c", "kill -9 $$")
	if r.code != 128+9 || !strings.Contains(r.stderr, "command killed by signal 9 (killed)") {
		t.Errorf("SIGKILLed command: %+v", r)
	}
	r = run(t, dsn, "run", "--lock", "st", "--", "sh", "-c", "exit 42")
	if r.code != 42 || !strings.Contains(r.stderr, "command exited with status 42") {
		t.Errorf("exit 42: %+v", r)
	}
	marker := newMarker()
	r = run(t, dsn, "run", "--lock", "st", "--grace", "1s", "--", "sh", "-c", "setsid sleep "+marker+" & sleep "+marker+" & exit 0")
	if r.code != 0 || !strings.Contains(r.stderr, "still run; stopping them") {
		t.Errorf("leftovers: %+v", r)
	}
	if left := markerProcs(marker); len(left) > 0 {
		killMarker(marker)
		t.Errorf("leftover processes survive pgfence: %q", left)
	}
	if v := lockState(t, dsn, "st"); v.State != "free" || v.Token != 3 {
		t.Errorf("lock after runs: %+v", v)
	}
}

// TestRunSuperviseDirect: the hidden supervisor entry point refuses to run
// without pgfence run's pipes.
func TestRunSuperviseDirect(t *testing.T) {
	t.Parallel()
	cmd := exec.Command(pgfenceBin(t), superviseArg, superviseProto, "1000000000", "/bin/true", "true")
	out, err := cmd.CombinedOutput()
	if cmd.ProcessState == nil || cmd.ProcessState.ExitCode() != ExitUsage || !strings.Contains(string(out), "internal to pgfence run") {
		t.Fatalf("direct __run-supervise: %v %q", err, out)
	}
}
