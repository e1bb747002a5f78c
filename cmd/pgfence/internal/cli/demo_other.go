//go:build !unix

package cli

import (
	"errors"
	"os"
)

var errNoPause = errors.New("pgfence demo needs a Unix system: it pauses a worker with SIGSTOP and resumes it with SIGCONT")

func pauseSupported() error { return errNoPause }

func pauseProcess(*os.Process) error { return errNoPause }

func resumeProcess(*os.Process) error { return errNoPause }
