package cli

// `pgfence run` on Linux: the command is started by a supervisor, pgfence
// itself re-executed (/proc/self/exe) as `pgfence __run-supervise`:
//
//	pgfence run ──(control pipe, report pipe)── supervisor ── command ── ...
//	 (own process group)                         (own group)   (own group)
//
//   - The supervisor is a child subreaper (PR_SET_CHILD_SUBREAPER): every
//     process the command starts, even one that leaves the command's process
//     group or session, is reparented to the supervisor when its parent dies,
//     never to init. So "the supervisor has no children left" (wait4 gives
//     ECHILD) means "the whole tree is gone".
//   - pgfence holds the write end of the control pipe and never closes it:
//     when pgfence dies, however it dies (SIGKILL, the OOM killer), the
//     kernel closes it and the supervisor reads EOF. It then sends SIGKILL to
//     the command's process group and to every child it has, again and again
//     until none is left, and exits. The lease row expires on its own.
//   - pgfence writes 'T' to stop the tree (SIGTERM to the command's process
//     group and to every other child of the supervisor, SIGKILL to all of
//     them after the grace period) or 'K' to kill it now.
//   - The supervisor reports on the report pipe "pid N" once the command
//     runs, then, once the tree is gone, "exit N" or "signal N" (the
//     command's own end) — or "error CODE MESSAGE" if the exec failed.
//   - The command has Pdeathsig SIGKILL (set from the supervisor's locked
//     main thread), so if the supervisor itself is SIGKILLed the command dies
//     too; pgfence then sends SIGKILL to the command's process group and does
//     not release the lease (it cannot know that nothing is left).
//   - The command inherits pgfence's standard files as they are (*os.File in
//     cmd/pgfence), so nothing in pgfence copies its output and no grandchild
//     can keep pgfence waiting on a pipe.
//
// The supervisor is dispatched from init (below), before main, so it works
// in every binary that links this package, the test binary included.

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

const (
	// superviseArg is the hidden first argument that turns pgfence into
	// `pgfence run`'s supervisor.
	superviseArg = "__run-supervise"
	// superviseProto is the version of the pipe protocol, the next argument.
	superviseProto = "1"

	prSetChildSubreaper = 36 // PR_SET_CHILD_SUBREAPER, linux/prctl.h

	// supervisorSlack is how long pgfence waits for the supervisor beyond
	// the grace period before it kills the supervisor and the command's
	// process group itself (the supervisor is stuck, e.g. a process in
	// uninterruptible sleep does not die on SIGKILL).
	supervisorSlack = 5 * time.Second
)

func init() {
	if len(os.Args) > 1 && os.Args[1] == superviseArg {
		os.Exit(superviseMain(os.Args[2:]))
	}
}

func runSupported() error { return nil }

// supervisedTree is pgfence's side of the supervisor.
type supervisedTree struct {
	cmd   *exec.Cmd
	grace time.Duration

	ctlMu  sync.Mutex
	ctl    *os.File // nil once the supervisor has exited
	stopAt time.Time

	cpid     atomic.Int64
	started  chan struct{} // closed on "pid N" or at the end of the reports
	startOne sync.Once
	doneCh   chan struct{}

	// Set by the report reader before doneCh is closed.
	final    bool
	status   cmdStatus
	startErr error
	res      treeResult
	fallback *time.Timer
}

func startTree(spec treeSpec) (procTree, error) {
	ctlR, ctlW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	repR, repW, err := os.Pipe()
	if err != nil {
		ctlR.Close()
		ctlW.Close()
		return nil, err
	}
	argv0 := "pgfence"
	if len(os.Args) > 0 {
		argv0 = filepath.Base(os.Args[0])
	}
	cmd := &exec.Cmd{
		// /proc/self/exe, not os.Executable(): it works even when the binary
		// was replaced or deleted since pgfence started.
		Path:        "/proc/self/exe",
		Args:        append([]string{argv0, superviseArg, superviseProto, strconv.FormatInt(int64(spec.grace), 10), spec.path}, spec.args...),
		Env:         spec.env,
		Stdin:       spec.stdin,
		Stdout:      spec.stdout,
		Stderr:      spec.stderr,
		ExtraFiles:  []*os.File{ctlR, repW}, // fds 3 and 4
		SysProcAttr: &syscall.SysProcAttr{Setpgid: true},
		// Only when the standard files are not *os.File (in-process use): the
		// supervisor exits after the tree is gone, so nothing holds the pipes;
		// this is a bound, not a wait.
		WaitDelay: time.Second,
	}
	err = cmd.Start()
	ctlR.Close()
	repW.Close()
	if err != nil {
		ctlW.Close()
		repR.Close()
		return nil, fmt.Errorf("start supervisor: %w", err)
	}
	t := &supervisedTree{cmd: cmd, grace: spec.grace, ctl: ctlW, started: make(chan struct{}), doneCh: make(chan struct{})}
	reports := make(chan struct{})
	go t.readReports(repR, reports)
	go t.wait(reports)
	<-t.started
	if t.cpid.Load() == 0 {
		<-t.doneCh
		if t.startErr != nil {
			return nil, t.startErr
		}
		return nil, fmt.Errorf("supervisor ended before starting %s: %v", spec.args[0], t.res.err)
	}
	return t, nil
}

func (t *supervisedTree) readReports(r *os.File, end chan<- struct{}) {
	defer close(end)
	defer r.Close()
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		kind, arg, _ := strings.Cut(sc.Text(), " ")
		switch kind {
		case "pid":
			if n, err := strconv.Atoi(arg); err == nil && n > 0 {
				t.cpid.Store(int64(n))
				t.startOne.Do(func() { close(t.started) })
			}
		case "exit", "signal":
			if n, err := strconv.Atoi(arg); err == nil {
				t.final = true
				if kind == "exit" {
					t.status = cmdStatus{code: n}
				} else {
					t.status = cmdStatus{signal: syscall.Signal(n)}
				}
			}
		case "error":
			code, msg, _ := strings.Cut(arg, " ")
			n, err := strconv.Atoi(code)
			if err != nil {
				n = ExitError
			}
			t.startErr = withCode(n, errors.New(msg))
		}
	}
	t.startOne.Do(func() { close(t.started) })
}

func (t *supervisedTree) wait(reports <-chan struct{}) {
	werr := t.cmd.Wait()
	<-reports
	t.ctlMu.Lock()
	t.ctl.Close()
	t.ctl = nil
	if t.fallback != nil {
		t.fallback.Stop()
	}
	t.ctlMu.Unlock()
	switch {
	case t.final:
		t.res = treeResult{status: t.status, gone: true}
	default:
		why := "supervisor ended without reporting the command's end"
		if werr != nil {
			why += " (" + werr.Error() + ")"
		}
		// The command had Pdeathsig SIGKILL; its group may remain.
		if pid := int(t.cpid.Load()); pid > 0 {
			_ = syscall.Kill(-pid, syscall.SIGKILL)
			// SIGKILL is delivered asynchronously: wait (bounded) until
			// the group is gone, so pgfence does not exit while its
			// processes are still dying.
			for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(time.Millisecond) {
				if syscall.Kill(-pid, 0) == syscall.ESRCH {
					break
				}
			}
			why += "; sent SIGKILL to its process group, processes that left the group may still run"
		}
		t.res = treeResult{err: errors.New(why)}
	}
	close(t.doneCh)
}

func (t *supervisedTree) pid() int              { return int(t.cpid.Load()) }
func (t *supervisedTree) done() <-chan struct{} { return t.doneCh }
func (t *supervisedTree) result() treeResult    { return t.res }
func (t *supervisedTree) stop()                 { t.send('T', t.grace+supervisorSlack) }
func (t *supervisedTree) kill()                 { t.send('K', supervisorSlack) }

// send writes a control byte and arms the fallback: if the supervisor has not
// exited within limit, pgfence kills it and the command's process group.
func (t *supervisedTree) send(b byte, limit time.Duration) {
	t.ctlMu.Lock()
	defer t.ctlMu.Unlock()
	if t.ctl == nil {
		return
	}
	_, _ = t.ctl.Write([]byte{b}) // EPIPE: the supervisor is gone, wait sees it
	at := time.Now().Add(limit)
	if t.fallback != nil && !at.Before(t.stopAt) {
		return
	}
	if t.fallback != nil {
		t.fallback.Stop()
	}
	t.stopAt = at
	t.fallback = time.AfterFunc(limit, func() {
		_ = t.cmd.Process.Kill()
		if pid := int(t.cpid.Load()); pid > 0 {
			_ = syscall.Kill(-pid, syscall.SIGKILL)
		}
	})
}

// ---- the supervisor process ----

// superviseMain is `pgfence __run-supervise PROTO GRACE_NS PATH ARGV...`,
// with the control pipe on fd 3 and the report pipe on fd 4.
func superviseMain(args []string) int {
	// A write to a closed stderr (pgfence's, which the supervisor shares)
	// returns EPIPE instead of killing the supervisor with SIGPIPE, as main
	// arranges for pgfence (main does not run here: the supervisor starts
	// from init). Killed, the supervisor could not report the tree's end,
	// and pgfence would leave the lease to expire. Caught, not ignored: the
	// command gets the default disposition at exec.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	if len(args) < 4 || args[0] != superviseProto || !isPipe(3) || !isPipe(4) {
		fmt.Fprintln(os.Stderr, "pgfence: __run-supervise is internal to pgfence run and cannot be used on its own")
		return ExitUsage
	}
	grace, err := strconv.ParseInt(args[1], 10, 64)
	if err != nil || grace <= 0 || time.Duration(grace) > maxGrace {
		fmt.Fprintln(os.Stderr, "pgfence: __run-supervise: bad grace period")
		return ExitUsage
	}
	// Pdeathsig fires when the thread that forked the command ends: fork
	// from this goroutine, locked to its thread for the life of the process
	// (during init that is the main thread).
	runtime.LockOSThread()
	syscall.CloseOnExec(3)
	syscall.CloseOnExec(4)
	s := &supervisor{
		ctl: os.NewFile(3, "pgfence-control"), rep: os.NewFile(4, "pgfence-report"),
		grace: time.Duration(grace), path: args[2], argv: args[3:], self: os.Getpid(),
		termed: map[int]bool{},
	}
	return s.run()
}

func isPipe(fd int) bool {
	var st syscall.Stat_t
	return syscall.Fstat(fd, &st) == nil && st.Mode&syscall.S_IFMT == syscall.S_IFIFO
}

type supervisor struct {
	ctl, rep *os.File
	grace    time.Duration
	path     string
	argv     []string
	self     int

	cpid    int
	reaped  bool // the command itself has been waited for
	status  cmdStatus
	termed  map[int]bool // children already sent SIGTERM
	killing bool
}

func (s *supervisor) report(format string, args ...any) {
	_, _ = fmt.Fprintf(s.rep, format+"\n", args...)
}

func (s *supervisor) run() int {
	if _, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0); e != 0 {
		s.report("error %d cannot become a child subreaper: %v", ExitError, e)
		return ExitError
	}
	// Wake-ups: children ending, and signals to the supervisor itself (it
	// is in a process group of its own, so only a deliberate kill reaches
	// it; it stops the tree like pgfence would). Notify, not Ignore: an
	// ignored signal would stay ignored in the command.
	chld := make(chan os.Signal, 1)
	signal.Notify(chld, syscall.SIGCHLD)
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, runSignals...)

	pid, err := syscall.ForkExec(s.path, s.argv, &syscall.ProcAttr{
		Env:   os.Environ(),
		Files: []uintptr{0, 1, 2},
		Sys:   &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL},
	})
	if err != nil {
		code := startErrCode(err)
		s.report("error %d cannot execute %s: %v", code, s.argv[0], err)
		return code
	}
	s.cpid = pid
	s.report("pid %d", pid)

	ctlEv := make(chan byte, 4)
	go func() {
		b := make([]byte, 1)
		for {
			n, err := s.ctl.Read(b)
			if n == 1 {
				ctlEv <- b[0]
			}
			if err != nil {
				ctlEv <- 0 // EOF: pgfence is gone
				return
			}
		}
	}()

	parentGone := false
	var graceC <-chan time.Time
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	killRounds := 0
	stopping := false
	startStop := func() {
		if stopping || s.killing {
			return
		}
		stopping = true
		graceC = time.After(s.grace)
		tick.Reset(50 * time.Millisecond) // to find reparented orphans
		s.signalTree(syscall.SIGTERM)
	}
	startKill := func() {
		if !s.killing {
			s.killing = true
			tick.Reset(10 * time.Millisecond)
		}
	}
	for {
		if s.reapAll() {
			break
		}
		if s.reaped && !stopping && !s.killing {
			fmt.Fprintf(os.Stderr, "pgfence: %s ended (%s) but processes it started still run; stopping them\n", s.argv[0], describeStatus(s.status))
			startStop()
		}
		switch {
		case s.killing:
			s.signalTree(syscall.SIGKILL)
			if killRounds++; killRounds == 200 {
				tick.Reset(200 * time.Millisecond) // something does not die (uninterruptible sleep): keep trying, slowly
			}
		case stopping:
			s.signalTree(syscall.SIGTERM) // only children not sent it yet
		}
		select {
		case <-chld:
		case <-tick.C:
		case <-sigs:
			startStop()
		case b := <-ctlEv:
			switch b {
			case 'T':
				startStop()
			case 'K':
				startKill()
			case 0:
				parentGone = true
				startKill()
			}
		case <-graceC:
			startKill()
		}
	}
	if !parentGone {
		if s.status.signal != 0 {
			s.report("signal %d", int(s.status.signal))
		} else {
			s.report("exit %d", s.status.code)
		}
	}
	return s.status.exitCode()
}

// reapAll waits for every child that has ended and reports whether none is
// left: then, since the supervisor is a subreaper, the tree is gone.
func (s *supervisor) reapAll() bool {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		switch {
		case err == syscall.EINTR:
			continue
		case err == syscall.ECHILD:
			return true
		case err != nil || pid <= 0:
			return false
		}
		delete(s.termed, pid)
		if pid == s.cpid {
			s.reaped = true
			if ws.Signaled() {
				s.status = cmdStatus{signal: ws.Signal()}
			} else {
				s.status = cmdStatus{code: ws.ExitStatus()}
			}
		}
	}
}

// signalTree sends sig to the command's process group while the command is
// not reaped (its pid is then still the group's id: no other group can have
// it) and to every child of the supervisor: the command and, once their
// parents died, any descendant, in the group or not. A child's pid cannot be
// reused before the supervisor reaps it, so these kills cannot hit a
// stranger. SIGTERM (followed by SIGCONT, for stopped processes) goes to each
// process once; SIGKILL every time.
func (s *supervisor) signalTree(sig syscall.Signal) {
	if !s.reaped && (sig == syscall.SIGKILL || !s.termed[s.cpid]) {
		_ = syscall.Kill(-s.cpid, sig)
		if sig == syscall.SIGTERM {
			_ = syscall.Kill(-s.cpid, syscall.SIGCONT) // a stopped process acts on SIGTERM only once continued
			s.termed[s.cpid] = true
		}
	}
	for _, c := range childrenOf(s.self) {
		if c == s.cpid && s.reaped {
			continue
		}
		if sig == syscall.SIGTERM {
			if s.termed[c] {
				continue
			}
			s.termed[c] = true
		}
		_ = syscall.Kill(c, sig)
		if sig == syscall.SIGTERM {
			_ = syscall.Kill(c, syscall.SIGCONT)
		}
	}
}

// childrenOf lists the children of pid: /proc/PID/task/*/children where the
// kernel has it, else a scan of /proc/*/stat.
func childrenOf(pid int) []int {
	var kids []int
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	ok := len(tasks) > 0
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue // a thread that just ended
			}
			ok = false
			break
		}
		for _, f := range strings.Fields(string(b)) {
			if n, err := strconv.Atoi(f); err == nil {
				kids = append(kids, n)
			}
		}
	}
	if ok {
		return kids
	}
	kids = kids[:0]
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, ok := procPPID(n); ok && ppid == pid {
			kids = append(kids, n)
		}
	}
	return kids
}

// procPPID reads the parent pid from /proc/PID/stat (the field after the
// state, which follows the last ')': the command name may contain any byte).
func procPPID(pid int) (int, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0, false
	}
	ppid, err := strconv.Atoi(f[1])
	return ppid, err == nil
}
