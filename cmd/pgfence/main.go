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
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], cli.Env{Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr})
	stop()
	os.Exit(code)
}
