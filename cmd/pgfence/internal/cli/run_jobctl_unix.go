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
// lease, no longer renewed, expires. pgfence stops the group, then itself;
// when continued (SIGCONT, from the shell's fg or bg) it continues the group.
func jobControl(tree procTree, s os.Signal) {
	select {
	case <-tree.done():
		return
	default:
	}
	switch s {
	case syscall.SIGTSTP:
		_ = syscall.Kill(-tree.pid(), syscall.SIGTSTP)
		_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
	case syscall.SIGCONT:
		_ = syscall.Kill(-tree.pid(), syscall.SIGCONT)
	}
}
