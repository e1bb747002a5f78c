//go:build unix

package cli

import (
	"os"
	"os/signal"
	"syscall"
)

// notifyJobControl delivers SIGTSTP and SIGCONT to ch, unless SIGTSTP is
// ignored (a shell without job control).
func notifyJobControl(ch chan<- os.Signal) {
	if !signal.Ignored(syscall.SIGTSTP) {
		signal.Notify(ch, syscall.SIGTSTP, syscall.SIGCONT)
	}
}

// jobControl keeps the command's process group in step with pgfence under
// job control: the command is not in pgfence's process group, so Ctrl-Z
// (SIGTSTP) would stop pgfence alone and leave the command running while its
// lease, no longer renewed, expires. pgfence stops the group, then itself.
// The group gets SIGTSTP, then SIGSTOP, which no process can catch or
// ignore: a command that ignores SIGTSTP kept running, its lease no longer
// renewed, and could write after the lease went to another holder. (A
// SIGTSTP still pending when the group is continued is discarded with the
// SIGCONT, so a handler does not stop the command again.) When continued
// (SIGCONT, from the shell's fg or bg) it continues the group only if
// leaseOK says the lease can still be counted on; else it kills the group,
// stopped, and reports true: a command continued there would run after the
// lease could have been granted to another holder. stopped says whether
// the tree is stopped now.
func jobControl(tree procTree, s os.Signal, leaseOK func() bool) (stopped, killed bool) {
	select {
	case <-tree.done():
		return false, false
	default:
	}
	switch s {
	case syscall.SIGTSTP:
		_ = syscall.Kill(-tree.pid(), syscall.SIGTSTP)
		_ = syscall.Kill(-tree.pid(), syscall.SIGSTOP)
		_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
		return true, false
	case syscall.SIGCONT:
		if !leaseOK() {
			tree.kill()
			return false, true
		}
		_ = syscall.Kill(-tree.pid(), syscall.SIGCONT)
	}
	return false, false
}
