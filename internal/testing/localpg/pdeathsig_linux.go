package localpg

import "syscall"

// setParentDeathSignal makes the postmaster get SIGQUIT (immediate shutdown)
// if the process that started it dies first, so no server outlives a killed
// parent.
func setParentDeathSignal(a *syscall.SysProcAttr) {
	a.Pdeathsig = syscall.SIGQUIT
}
