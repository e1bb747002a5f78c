// Command pgfence inspects and uses pgfence's lock table and fenced tables:
// migrations, lock listings, fence checks, running a command under a lease, and
// a demo of the paused-worker bug and its fix. Run `pgfence --help`.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/pgfence/pgfence/cmd/pgfence/internal/cli"
)

func main() {
	// A write to a closed stdout or stderr (acquire | true, a reader gone)
	// returns EPIPE instead of killing the process with SIGPIPE, so that the
	// command's error paths run: acquire releases the lease it could not
	// hand over. Caught, not ignored: a command that run starts gets the
	// default disposition at exec, as it did before.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], cli.Env{Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr})
	stop()
	os.Exit(code)
}
