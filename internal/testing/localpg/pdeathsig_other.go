//go:build unix && !linux

package localpg

import "syscall"

// setParentDeathSignal does nothing: only Linux has a parent-death signal.
// A postmaster whose parent was killed keeps running; its directory is swept
// by the next Start once that parent is gone.
func setParentDeathSignal(*syscall.SysProcAttr) {}
