//go:build unix && !linux

package cli

// `pgfence run` on Unix systems other than Linux: the command runs in a
// process group of its own and pgfence signals the group. There is no
// supervisor (no portable child subreaper, no parent-death signal): processes
// that leave the group are not stopped, and if pgfence is killed with SIGKILL
// the command keeps running. The command's Long help and docs/cli.md say so.

import (
	"errors"
	"fmt"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

func runSupported() error { return nil }

// groupTree is a command in its own process group.
type groupTree struct {
	cmd    *exec.Cmd
	spec   treeSpec
	stopCh chan struct{}
	killCh chan struct{}
	stopMu sync.Once
	killMu sync.Once
	doneCh chan struct{}
	res    treeResult
}

func startTree(spec treeSpec) (procTree, error) {
	cmd := &exec.Cmd{
		Path: spec.path, Args: spec.args, Env: spec.env,
		Stdin: spec.stdin, Stdout: spec.stdout, Stderr: spec.stderr,
		SysProcAttr: &syscall.SysProcAttr{Setpgid: true},
		// Only when the standard files are not *os.File: a process left in
		// the group would hold the pipe; it is killed with the group.
		WaitDelay: time.Second,
	}
	if err := cmd.Start(); err != nil {
		return nil, withCode(startErrCode(err), fmt.Errorf("cannot execute %s: %v", spec.args[0], unwrapPathErr(err)))
	}
	t := &groupTree{cmd: cmd, spec: spec, stopCh: make(chan struct{}), killCh: make(chan struct{}), doneCh: make(chan struct{})}
	go t.supervise()
	return t, nil
}

func (t *groupTree) pid() int              { return t.cmd.Process.Pid }
func (t *groupTree) done() <-chan struct{} { return t.doneCh }
func (t *groupTree) result() treeResult    { return t.res }
func (t *groupTree) stop()                 { t.stopMu.Do(func() { close(t.stopCh) }) }
func (t *groupTree) kill()                 { t.killMu.Do(func() { close(t.killCh) }) }

func (t *groupTree) supervise() {
	defer close(t.doneCh)
	pgid := t.cmd.Process.Pid
	waited := make(chan struct{})
	go func() {
		_ = t.cmd.Wait()
		close(waited)
	}()
	var (
		exited, stopping, killing bool
		graceC                    <-chan time.Time
		killedAt                  time.Time
		stopCh, killCh            = t.stopCh, t.killCh
		tickC                     <-chan time.Time // polls the group once the command ended or is being killed
	)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	toStop := func() {
		if !stopping {
			stopping = true
			_ = syscall.Kill(-pgid, syscall.SIGTERM)
			_ = syscall.Kill(-pgid, syscall.SIGCONT) // a stopped process acts on SIGTERM only once continued
			graceC = time.After(t.spec.grace)
		}
	}
	toKill := func() {
		if !killing {
			killing, killedAt, tickC = true, time.Now(), tick.C
		}
	}
	for {
		if exited {
			// The group's id cannot be reused while the group has members.
			if err := syscall.Kill(-pgid, 0); errors.Is(err, syscall.ESRCH) {
				t.res = treeResult{status: waitStatus(t.cmd), gone: true}
				return
			}
			if !stopping {
				notef(t.spec.notes, "pgfence: %s ended but processes of its group still run; stopping them", t.spec.args[0])
				toStop()
			}
		}
		if killing {
			if time.Since(killedAt) > supervisorSlack {
				t.res = treeResult{err: fmt.Errorf("process group %d still exists %v after SIGKILL", pgid, supervisorSlack)}
				if exited {
					t.res.status = waitStatus(t.cmd)
				}
				return
			}
			_ = syscall.Kill(-pgid, syscall.SIGKILL)
		}
		select {
		case <-waited:
			exited, waited, tickC = true, nil, tick.C
		case <-stopCh:
			stopCh = nil
			toStop()
		case <-killCh:
			killCh = nil
			toKill()
		case <-graceC:
			graceC = nil
			toKill()
		case <-tickC:
		}
	}
}

// supervisorSlack bounds how long pgfence waits for a killed group to vanish.
const supervisorSlack = 5 * time.Second

func waitStatus(cmd *exec.Cmd) cmdStatus {
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return cmdStatus{signal: ws.Signal()}
	}
	return cmdStatus{code: cmd.ProcessState.ExitCode()}
}
