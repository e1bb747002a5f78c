//go:build !unix

package cli

import (
	"errors"
	"os"
)

// runSupported refuses `pgfence run` where pgfence cannot stop the command's
// whole process tree: a lease must not be held by a command pgfence cannot
// stop when the lease is lost.
func runSupported() error {
	return errors.New("pgfence run needs a Unix system: on this platform pgfence cannot stop the command's process tree when the lease is lost")
}

func startTree(treeSpec) (procTree, error) { return nil, runSupported() }

func notifyJobControl(chan<- os.Signal) {}

func jobControl(procTree, os.Signal, func() bool) (stopped, killed bool) { return false, false }
