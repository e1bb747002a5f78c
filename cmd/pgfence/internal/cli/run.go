package cli

// `pgfence run`: the part shared by all platforms. The process tree itself
// (starting the command, stopping it, knowing when it is gone) is in
// run_linux.go (a supervisor process), run_unix.go (other Unix systems: a
// process group) and run_other.go (no support).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/pglock"
)

// Exit codes of `pgfence run` when COMMAND cannot be started. They are the
// numbers POSIX shells use. No lease is taken when resolveCommand finds the
// failure; one the exec finds comes after the lease is taken (released
// then).
const (
	ExitCannotExecute   = 126 // `pgfence run`: COMMAND was found but cannot be executed
	ExitCommandNotFound = 127 // `pgfence run`: COMMAND was not found (or is empty)
)

// maxGrace is the longest --grace: a day, the longest lease
// (pglock.MaxTTL). The bound keeps every sum pgfence run makes with the
// grace period (grace+supervisorSlack, a deadline grace from now) far from
// overflowing a time.Duration.
const maxGrace = 24 * time.Hour

// secretEnv lists the environment variables that `pgfence run` removes from
// the command's environment unless --pass-env is given: the variables that
// can carry the lock database's password. Variables that only name a file
// (PGPASSFILE, PGSSLKEY, PGSERVICEFILE) or carry no secret (PGHOST, PGUSER,
// ...) are kept.
var secretEnv = []string{"DATABASE_URL", "PGPASSWORD", "PGSSLPASSWORD"}

// runSignals are the signals that make `pgfence run` stop the command's tree
// and exit with 128+signal.
var runSignals = []os.Signal{syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT}

// treeSpec describes the command `pgfence run` starts.
type treeSpec struct {
	path           string   // the resolved executable
	args           []string // argv; args[0] as the user typed it
	env            []string
	stdin          io.Reader
	stdout, stderr io.Writer
	notes          io.Writer // pgfence's own messages
	grace          time.Duration
}

// procTree is a started command with every process it starts. Stop and kill
// are idempotent and never block.
type procTree interface {
	// pid is the command's process id (also its process group id).
	pid() int
	// stop sends SIGTERM to the tree, then SIGKILL after the grace period.
	stop()
	// kill sends SIGKILL to the tree now.
	kill()
	// done is closed when the tree is gone or cannot be stopped.
	done() <-chan struct{}
	// result is valid once done is closed.
	result() treeResult
}

// treeResult is how a tree ended.
type treeResult struct {
	status cmdStatus // how the command itself ended
	gone   bool      // every process of the tree is known to be gone
	err    error     // when !gone: why pgfence cannot tell
}

// cmdStatus is how a command ended: an exit status, or the signal that
// killed it.
type cmdStatus struct {
	code   int
	signal syscall.Signal // 0 when the command exited
}

// exitCode is the shell's convention: the status, or 128+signal.
func (s cmdStatus) exitCode() int {
	if s.signal != 0 {
		return 128 + int(s.signal)
	}
	return s.code
}

// err is nil for status 0, else an error carrying exitCode.
func (s cmdStatus) err() error {
	switch {
	case s.signal != 0:
		return withCode(s.exitCode(), fmt.Errorf("command killed by signal %d (%v)", int(s.signal), s.signal))
	case s.code != 0:
		return withCode(s.code, fmt.Errorf("command exited with status %d", s.code))
	}
	return nil
}

// resolveCommand finds name like a shell would (exec.LookPath) before any
// lease is taken: 127 if it does not exist, 126 if it is not executable.
// For a script it also checks the interpreter of its #! line
// (checkInterpreter).
func resolveCommand(name string) (string, error) {
	if name == "" {
		return "", withCode(ExitCommandNotFound, errors.New("command not found: empty command name"))
	}
	p, err := exec.LookPath(name)
	switch {
	case err == nil:
		if err := checkInterpreter(name, p); err != nil {
			return "", err
		}
		return p, nil
	case errors.Is(err, exec.ErrDot):
		return "", withCode(ExitCommandNotFound, fmt.Errorf("command not found: %s is %s in the current directory, which is refused when found through PATH; run ./%s", name, p, name))
	case errors.Is(err, exec.ErrNotFound), errors.Is(err, fs.ErrNotExist), errors.Is(err, syscall.ENOTDIR):
		return "", withCode(ExitCommandNotFound, fmt.Errorf("command not found: %s", name))
	}
	return "", withCode(ExitCannotExecute, fmt.Errorf("cannot execute %s: %v", name, unwrapPathErr(err)))
}

// shebangBuf is how much of a file Linux reads to find a #! line
// (BINPRM_BUF_SIZE).
const shebangBuf = 256

// checkInterpreter checks the interpreter named on the #! line of the file
// at path (name as the user typed it), as the exec would find it: 127 if it
// does not exist, 126 if it is not an executable file. The line is parsed
// as Linux parses it: after "#!" and any spaces or tabs, the interpreter
// runs up to the first space, tab, NUL or newline, within the first
// shebangBuf bytes (so the "\r" of a file with CRLF line endings is part of
// it, and the kernel does not find it either); a relative interpreter is
// relative to the current directory, which the command inherits (not to
// the script's directory, and not looked up in PATH).
//
// Only that is checked here, not every way an exec can fail. These fail at
// the exec, after the lease is taken (which is then released; exit 126, or
// 127 when the kernel reports a missing file): a file pgfence cannot read
// (execute-only), a #! line with no interpreter or whose interpreter does not
// end within shebangBuf bytes, an interpreter that is itself a script with a
// bad #! line, a file format the kernel cannot run, a missing ELF
// interpreter (dynamic loader), a noexec mount, and a file changed between
// this check and the exec.
func checkInterpreter(name, path string) error {
	if fi, err := os.Stat(path); err != nil || !fi.Mode().IsRegular() {
		return nil // left to the exec (an open would wait on a FIFO)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil // left to the exec
	}
	defer f.Close()
	buf := make([]byte, shebangBuf)
	n, _ := io.ReadFull(f, buf)
	buf = buf[:n]
	if !bytes.HasPrefix(buf, []byte("#!")) {
		return nil
	}
	// ended: the line ends within what the kernel reads (at a newline, or
	// at the end of a shorter file).
	line, ended := buf[2:], n < shebangBuf
	if i := bytes.IndexByte(line, '\n'); i >= 0 {
		line, ended = line[:i], true
	}
	line = bytes.TrimLeft(line, " \t")
	if i := bytes.IndexAny(line, " \t\x00"); i >= 0 {
		line = line[:i]
	} else if !ended {
		return nil // the interpreter may go on past what the kernel reads: it refuses the exec
	}
	if len(line) == 0 {
		return nil // no interpreter: left to the exec
	}
	interp := string(line)
	lookup := interp
	if !strings.Contains(interp, "/") {
		lookup = "./" + interp // exec.LookPath would search PATH; the kernel does not
	}
	if _, err := exec.LookPath(lookup); err != nil {
		hint := ""
		if strings.HasSuffix(interp, "\r") {
			hint = " (the script has CRLF line endings)"
		} else if !filepath.IsAbs(interp) {
			hint = " (relative to the current directory)"
		}
		code := startErrCode(err)
		what := "does not exist"
		if code != ExitCommandNotFound {
			what = fmt.Sprintf("cannot be executed: %v", unwrapPathErr(err))
		}
		return withCode(code, fmt.Errorf("bad interpreter: the #! line of %s names %q%s, which %s", name, interp, hint, what))
	}
	return nil
}

// startErrCode maps the error of an exec to 127 (not found) or 126.
func startErrCode(err error) int {
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ENOTDIR) {
		return ExitCommandNotFound
	}
	return ExitCannotExecute
}

func unwrapPathErr(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	var ee *exec.Error
	if errors.As(err, &ee) {
		return ee.Err
	}
	return err
}

// childEnv is the command's environment: environ without the PGFENCE_*
// variables it sets and, unless passEnv, without secretEnv.
func childEnv(environ []string, passEnv bool, lease *pglock.Lease) []string {
	// PGFENCE_KEY and PGFENCE_EXPIRES_AT, exported after an earlier
	// `pgfence acquire`, belong to another lease: the command must not see
	// that lease's key beside this lease's name and token.
	drop := map[string]bool{"PGFENCE_LOCK": true, "PGFENCE_TOKEN": true, "PGFENCE_HOLDER": true,
		"PGFENCE_KEY": true, "PGFENCE_EXPIRES_AT": true}
	if !passEnv {
		for _, k := range secretEnv {
			drop[k] = true
		}
	}
	env := make([]string, 0, len(environ)+3)
	for _, kv := range environ {
		k, _, _ := strings.Cut(kv, "=")
		if !drop[k] {
			env = append(env, kv)
		}
	}
	return append(env,
		"PGFENCE_LOCK="+lease.Name(),
		"PGFENCE_TOKEN="+strconv.FormatInt(lease.Token(), 10),
		"PGFENCE_HOLDER="+lease.Holder(),
	)
}

// notifyRunSignals delivers runSignals to ch, except those pgfence was
// started with ignored (nohup, a background job of a non-interactive shell):
// catching them would undo the ignore.
func notifyRunSignals(ch chan<- os.Signal) {
	var sigs []os.Signal
	for _, s := range runSignals {
		if !signal.Ignored(s) {
			sigs = append(sigs, s)
		}
	}
	signal.Notify(ch, sigs...)
}

// runLeased is `pgfence run`: resolve the command, take the lease, run the
// command's tree, stop it on loss or signal, release the lease once the tree
// is gone.
func (a *app) runLeased(ctx context.Context, f *leaseFlags, grace time.Duration, passEnv bool, args []string) error {
	if grace <= 0 || grace > maxGrace {
		return usageErr("--grace %v: must be more than 0 and at most %v", grace, maxGrace)
	}
	if err := f.check(); err != nil {
		return err
	}

	path, err := resolveCommand(args[0])
	if err != nil {
		return err
	}
	if err := runSupported(); err != nil {
		return err
	}

	// pgfence's notes and (when they are not files) the command's output,
	// copied by os/exec's goroutines, are serialised on one lock.
	var outMu sync.Mutex
	notes := &lockedWriter{mu: &outMu, w: a.env.Stderr}
	stdout, stderr := passWriter(a.env.Stdout, &outMu), passWriter(a.env.Stderr, &outMu)

	sigs := make(chan os.Signal, 8)
	notifyRunSignals(sigs)
	defer signal.Stop(sigs)

	// Acquire, unless a signal comes first (Acquire may wait for a long time).
	type taken struct {
		lease   *pglock.Lease
		cleanup func()
		err     error
	}
	actx, acancel := context.WithCancel(ctx)
	defer acancel()
	tc := make(chan taken, 1)
	go func() {
		_, lease, cleanup, err := a.takeLease(actx, f, true)
		tc <- taken{lease, cleanup, err}
	}()
	var tk taken
	select {
	case tk = <-tc:
	case s := <-sigs:
		acancel()
		tk = <-tc
		if tk.err == nil {
			a.releaseLease(ctx, tk.lease, notes)
			tk.cleanup()
		}
		return withCode(128+sigNum(s), fmt.Errorf("got %v before the lease was taken; %s was not started", s, args[0]))
	}
	if tk.err != nil {
		return tk.err
	}
	lease := tk.lease
	defer tk.cleanup()

	// Job-control signals are registered before the command starts: the Go
	// runtime drops a SIGTSTP that arrives before signal.Notify, so a Ctrl-Z
	// right after the start would otherwise stop nothing.
	jc := make(chan os.Signal, 2)
	notifyJobControl(jc)
	defer signal.Stop(jc)
	tree, err := startTree(treeSpec{
		path: path, args: args, env: childEnv(os.Environ(), passEnv, lease),
		stdin: a.env.Stdin, stdout: stdout, stderr: stderr, notes: notes, grace: grace,
	})
	if err != nil {
		a.releaseLease(ctx, lease, notes)
		return err
	}
	notef(notes, "pgfence: lock %q held, token %d; started %s (pid %d)", lease.Name(), lease.Token(), args[0], tree.pid())
	var (
		lost        bool
		got         os.Signal
		interrupted bool
		leaseDone   = lease.Done()
		ctxDone     = ctx.Done()
	)
	// A lease that is not renewed (the database unreachable) ends at its
	// local deadline, which is before the database can grant it to anyone
	// else. Stopping at the deadline left the command running for --grace
	// after it: the tree gets SIGTERM lead before the deadline unless the
	// lease was renewed meanwhile, and SIGKILL a tenth of lead before it
	// (time for the signal and the kernel). lead is --grace, at most a third
	// of the TTL: renewals come every third of it, and an earlier stop
	// would stop a lease whose next renewal is still to come.
	lead := min(grace, f.ttl/3)
	const (
		phaseTerm = iota
		phaseKill
		phaseDone
	)
	phase := phaseTerm
	// stopped: Ctrl-Z stopped the tree, and it has not been continued.
	stopped := false
	// stop ends the tree: SIGTERM, which comes with a SIGCONT, then SIGKILL
	// after the grace period. But when the tree is stopped (Ctrl-Z) or the
	// lease's deadline is within lead/10 (pgfence was stopped or starved
	// past it), SIGKILL now: the SIGCONT would let a stopped tree run again,
	// possibly after the lease went to another holder. note is the note
	// for a SIGTERM; killNote the one for a SIGKILL.
	stop := func(note, killNote string) {
		if stopped || time.Until(lease.Deadline()) <= lead/10 {
			phase = phaseDone
			notef(notes, "%s", killNote)
			tree.kill()
			return
		}
		notef(notes, "%s", note)
		tree.stop()
	}
	killNote := func(what string) string {
		return fmt.Sprintf("pgfence: %s; sending SIGKILL to %s and every process it started", what, args[0])
	}
	expiring := time.NewTimer(time.Until(lease.Deadline().Add(-lead)))
	defer expiring.Stop()
	for waiting := true; waiting; {
		select {
		case <-tree.done():
			waiting = false
		case <-expiring.C:
			d := lease.Deadline()
			switch {
			case phase == phaseTerm && time.Until(d) > lead:
				expiring.Reset(time.Until(d.Add(-lead))) // renewed meanwhile
			case phase == phaseTerm:
				phase = phaseKill
				if !lost && got == nil && !interrupted {
					lost = true
					left := time.Until(d).Round(time.Millisecond)
					stop(fmt.Sprintf("pgfence: lease on %q not renewed, ending in %v; stopping %s and every process it started (SIGTERM, SIGKILL before it ends)",
						lease.Name(), left, args[0]), killNote(fmt.Sprintf("lease on %q not renewed, ending in %v", lease.Name(), left)))
				} else if stopped {
					stop("", killNote(fmt.Sprintf("lease on %q ends in %v", lease.Name(), time.Until(d).Round(time.Millisecond))))
				}
				if phase == phaseKill {
					expiring.Reset(time.Until(d.Add(-lead / 10)))
				}
			case phase == phaseKill:
				if time.Until(d) > lead/10 {
					// Renewed after the SIGTERM: the stop goes on, and its
					// SIGKILL still comes before the latest deadline.
					expiring.Reset(time.Until(d.Add(-lead / 10)))
					continue
				}
				phase = phaseDone
				notef(notes, "%s", killNote(fmt.Sprintf("lease on %q ends in %v", lease.Name(), time.Until(d).Round(time.Millisecond))))
				tree.kill()
			}
		case <-leaseDone:
			leaseDone = nil
			lost = true
			what := fmt.Sprintf("lease on %q lost (%v)", lease.Name(), lease.Err())
			stop(fmt.Sprintf("pgfence: %s; stopping %s and every process it started (SIGTERM, SIGKILL after %v)", what, args[0], grace), killNote(what))
		case s := <-sigs:
			if got == nil {
				got = s
				what := fmt.Sprintf("got %v", s)
				stop(fmt.Sprintf("pgfence: %s; stopping %s and every process it started (SIGTERM, SIGKILL after %v)", what, args[0], grace), killNote(what))
			} else {
				notef(notes, "pgfence: got %v again; sending SIGKILL to %s and every process it started", s, args[0])
				tree.kill()
			}
		case s := <-jc:
			// Continued: the lease is counted on only while it is live and
			// more than lead from its deadline (the point where the tree
			// would be stopped anyway); else the tree, stopped, is killed.
			leaseOK := func() bool { return lease.Err() == nil && time.Until(lease.Deadline()) > lead }
			var killed bool
			stopped, killed = jobControl(tree, s, leaseOK)
			if killed {
				phase = phaseDone
				if !lost && got == nil && !interrupted {
					lost = true
				}
				notef(notes, "pgfence: continued after the lease on %q ended or came within %v of its end; sent SIGKILL to %s and every process it started, which were stopped",
					lease.Name(), lead, args[0])
			}
		case <-ctxDone:
			// The in-process caller's context; with cmd/pgfence also SIGINT
			// and SIGTERM, which arrive on sigs as well.
			ctxDone = nil
			interrupted = true
			if stopped || time.Until(lease.Deadline()) <= lead/10 {
				phase = phaseDone
				tree.kill()
			} else {
				tree.stop()
			}
		}
	}
	if interrupted && got == nil {
		// cmd/pgfence cancels ctx on SIGINT and SIGTERM; the same signal
		// reaches sigs in the same instant, but may be read after the tree
		// is gone. Wait briefly for it so the exit code names it.
		select {
		case got = <-sigs:
		case <-time.After(250 * time.Millisecond):
		}
	}
	res := tree.result()
	if !lost && lease.Err() != nil {
		// Lost while the command ended: it may have run without the lease.
		lost = true
		notef(notes, "pgfence: lease on %q lost (%v) as %s ended", lease.Name(), lease.Err(), args[0])
	}
	if !res.gone {
		// Fail closed: the lease is not handed on while something may still
		// run under it; it expires on the database clock instead.
		notef(notes, "pgfence: not releasing %q: processes of %s may still run (%v); the lease expires at %s (database clock)",
			lease.Name(), args[0], res.err, lease.ExpiresAt().UTC().Format(time.RFC3339))
	} else if !lost || (lease.Err() == nil && time.Until(lease.Deadline()) > lead) {
		// Released once the tree is gone; also a lease whose command was
		// stopped because it was ending, but which was renewed meanwhile
		// (one still ending is left to end: the database is likely out of
		// reach, and a release would wait for it).
		if rerr := a.releaseLease(ctx, lease, notes); errors.Is(rerr, pgfence.ErrLost) {
			lost = true
		}
	}
	switch {
	case lost:
		return withCode(ExitLeaseLost, fmt.Errorf("lease on %q lost while %s ran", lease.Name(), args[0]))
	case !res.gone:
		return withCode(ExitError, fmt.Errorf("%s could not be stopped: %w", args[0], res.err))
	case got != nil:
		return withCode(128+sigNum(got), fmt.Errorf("got %v; %s stopped (%s)", got, args[0], describeStatus(res.status)))
	case interrupted:
		return withCode(ExitError, fmt.Errorf("interrupted; %s stopped (%s)", args[0], describeStatus(res.status)))
	}
	return res.status.err()
}

// releaseLease releases lease, even when ctx is cancelled, and reports
// failures on notes.
func (a *app) releaseLease(ctx context.Context, lease *pglock.Lease, notes io.Writer) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	err := lease.Release(rctx)
	if err != nil {
		notef(notes, "pgfence: release %q: %v", lease.Name(), err)
	}
	return err
}

func describeStatus(s cmdStatus) string {
	if s.signal != 0 {
		return fmt.Sprintf("killed by signal %d (%v)", int(s.signal), s.signal)
	}
	return fmt.Sprintf("exit status %d", s.code)
}

func sigNum(s os.Signal) int {
	if n, ok := s.(syscall.Signal); ok {
		return int(n)
	}
	return 0
}

// passWriter returns w itself when it is a file, so the command writes to it
// directly (no copying goroutine for a grandchild to hold open), else w
// serialised on mu.
func passWriter(w io.Writer, mu *sync.Mutex) io.Writer {
	if f, ok := w.(*os.File); ok {
		return f
	}
	return &lockedWriter{mu: mu, w: w}
}
