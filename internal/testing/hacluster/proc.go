package hacluster

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// proc is a process this package started and waits for.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

// startProc starts path with args in its own session (so a terminal's
// signals do not reach it and no wrapper process stays behind as its
// parent), as cred when cred is not nil, with its output appended to logPath.
func startProc(name, path string, args []string, dir string, env []string, cred *syscall.Credential, logPath string) (*proc, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(path, args...)
	cmd.Dir = dir
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: cred}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// kill sends SIGCONT (a stopped process would not act on other signals) and
// SIGKILL, then waits up to d for the process to be reaped.
func (p *proc) kill(d time.Duration) error {
	if p.exited() {
		return nil
	}
	_ = p.cmd.Process.Signal(syscall.SIGCONT)
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-p.done:
		return nil
	case <-time.After(d):
		return fmt.Errorf("%s (pid %d) still running %v after SIGKILL", p.name, p.pid(), d)
	}
}

// procInfo is what /proc says about one process.
type procInfo struct {
	PID     int
	PPID    int
	State   byte // R, S, D, T, Z, ...
	Cmdline string
}

// readProc reads /proc/<pid>; ok is false when the process does not exist.
func readProc(pid int) (procInfo, bool) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procInfo{}, false
	}
	// "pid (comm) S ppid ...": comm may hold spaces and parentheses.
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 || i+2 >= len(stat) {
		return procInfo{}, false
	}
	f := strings.Fields(string(stat[i+2:]))
	if len(f) < 2 {
		return procInfo{}, false
	}
	info := procInfo{PID: pid, State: f[0][0]}
	info.PPID, _ = strconv.Atoi(f[1])
	cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	info.Cmdline = strings.TrimSpace(string(bytes.ReplaceAll(cmd, []byte{0}, []byte{' '})))
	return info, true
}

// alive reports whether pid exists and is not a zombie. A zombie has exited;
// it only waits for its parent (often init) to reap it.
func alive(pid int) bool {
	info, ok := readProc(pid)
	return ok && info.State != 'Z'
}

// allProcs lists every process in /proc.
func allProcs() []procInfo {
	ents, _ := os.ReadDir("/proc")
	var out []procInfo
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if info, ok := readProc(pid); ok {
			out = append(out, info)
		}
	}
	return out
}

// processesWith lists the live (non-zombie) processes, other than this one,
// whose command line contains token.
func processesWith(token string) []procInfo {
	self := os.Getpid()
	var out []procInfo
	for _, p := range allProcs() {
		if p.PID == self || p.State == 'Z' || !strings.Contains(p.Cmdline, token) {
			continue
		}
		out = append(out, p)
	}
	return out
}

// childrenOf lists the live children of pid.
func childrenOf(pid int) []int {
	var out []int
	for _, p := range allProcs() {
		if p.PPID == pid && p.State != 'Z' {
			out = append(out, p.PID)
		}
	}
	return out
}

// postmasterPID reads dataDir/postmaster.pid and returns the pid if that
// process is alive and really is the postmaster of dataDir (its command line
// names the directory), so a stale file never makes us signal a stranger.
func postmasterPID(dataDir string) (int, error) {
	b, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		return 0, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("postmaster.pid of %s: bad pid %q", dataDir, line)
	}
	info, ok := readProc(pid)
	if !ok || info.State == 'Z' {
		return 0, fmt.Errorf("postmaster %d of %s: %w", pid, dataDir, errNotRunning)
	}
	if !strings.Contains(info.Cmdline, dataDir) {
		return 0, fmt.Errorf("pid %d from %s/postmaster.pid is %q, not its postmaster: %w", pid, dataDir, info.Cmdline, errNotRunning)
	}
	return pid, nil
}

var errNotRunning = errors.New("not running")

// reaperScript runs in a process of its own session. It reads its standard
// input, a pipe whose write end only the test process holds: when the test
// process ends for any reason (a test timeout's panic, SIGKILL, a crash),
// the pipe reaches EOF and the script kills every process whose command
// line contains the cluster's token (patroni first, so it does not restart
// PostgreSQL; then SIGQUIT, PostgreSQL's immediate shutdown; then SIGKILL)
// and removes the cluster's directory. A normal Stop writes "done" first and
// the script exits without doing anything. The token is passed in the
// environment and to grep on its standard input, never on a command line,
// so the sweep cannot match itself; one grep reads every command line (a
// fork per process would take many seconds on a loaded machine).
const reaperScript = `trap '' INT TERM HUP QUIT PIPE
while read -r line; do
  [ "$line" = done ] && exit 0
done
sweep() {
  n=0
  pids=$(printf '%s\n' "$HACLUSTER_TOKEN" | grep -laF -f - /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3)
  for p in $pids; do
    [ "$p" = "$$" ] && continue
    if [ "$2" = patroni ]; then grep -qaF patroni "/proc/$p/cmdline" 2>/dev/null || continue; fi
    kill -CONT "$p" 2>/dev/null; kill -"$1" "$p" 2>/dev/null && n=$((n+1))
  done
  [ "$n" -gt 0 ]
}
sweep KILL patroni
if sweep QUIT all; then sleep 2; sweep KILL all && sleep 1; sweep KILL all; fi
rm -rf "$HACLUSTER_DIR"
`

// reaper is the watchdog process described at reaperScript.
type reaper struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	done chan struct{}
}

func startReaper(token, dir string) (*reaper, error) {
	cmd := exec.Command("/bin/sh", "-c", reaperScript)
	cmd.Env = []string{"PATH=/usr/bin:/bin", "HACLUSTER_TOKEN=" + token, "HACLUSTER_DIR=" + dir}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start reaper: %w", err)
	}
	r := &reaper{cmd: cmd, in: in, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(r.done) }()
	return r, nil
}

// finish tells the reaper everything is gone (disarm true) or lets it sweep
// (disarm false), and waits for it.
func (r *reaper) finish(disarm bool) {
	if disarm {
		_, _ = io.WriteString(r.in, "done\n")
	}
	_ = r.in.Close()
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		_ = r.cmd.Process.Kill()
		<-r.done
	}
}
