//go:build unix

package cli

import (
	"os"
	"syscall"
)

// pauseSupported reports whether the demo can pause and resume its workers
// here: on Unix systems it can.
func pauseSupported() error { return nil }

// pauseProcess stops p as a GC pause or a VM stall would (SIGSTOP).
func pauseProcess(p *os.Process) error { return p.Signal(syscall.SIGSTOP) }

// resumeProcess lets a paused p run again (SIGCONT).
func resumeProcess(p *os.Process) error { return p.Signal(syscall.SIGCONT) }
