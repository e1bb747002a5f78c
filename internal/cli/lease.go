package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/pglock"
)

type leaseFlags struct {
	lock   string
	ttl    time.Duration
	noWait bool
	holder string
}

func (f *leaseFlags) register(cmd *cobra.Command, defTTL time.Duration) {
	cmd.Flags().StringVar(&f.lock, "lock", "", "lock name (required)")
	cmd.Flags().DurationVar(&f.ttl, "ttl", defTTL, "lease duration, decided on the database clock")
	cmd.Flags().BoolVar(&f.noWait, "no-wait", false, "fail at once with exit code 75 if the lock is held")
	cmd.Flags().StringVar(&f.holder, "holder", "", "holder identity stored in the lock row (default hostname/pid/random)")
}

func (a *app) addLeaseCommands(root *cobra.Command) {
	root.AddCommand(a.runCommand(), a.acquireCommand(), a.renewCommand(), a.releaseCommand())
}

// takeLease connects, builds a Locker and acquires (or try-acquires) f.lock.
func (a *app) takeLease(ctx context.Context, f *leaseFlags, keepAlive bool) (*pglock.Locker, *pglock.Lease, func(), error) {
	if f.lock == "" {
		return nil, nil, nil, usageErr("--lock is required")
	}
	pool, err := a.connectMigrated(ctx)
	if err != nil {
		return nil, nil, nil, err
	}
	locker, err := pglock.New(pool, &pglock.Config{Holder: f.holder, KeepAlive: keepAlive})
	if err != nil {
		pool.Close()
		return nil, nil, nil, withCode(ExitUsage, err)
	}
	cleanup := func() {
		_ = locker.Close()
		pool.Close()
	}
	var lease *pglock.Lease
	if f.noWait {
		lease, err = locker.TryAcquire(ctx, f.lock, f.ttl)
	} else {
		lease, err = locker.Acquire(ctx, f.lock, f.ttl)
	}
	if err != nil {
		cleanup()
		var le *pglock.LockedError
		switch {
		case errors.As(err, &le):
			return nil, nil, nil, withCode(ExitLockBusy, fmt.Errorf("lock %q is busy: held by %s until %s", le.Name, le.Holder, le.ExpiresAt.UTC().Format(time.RFC3339)))
		case errors.Is(err, pglock.ErrInvalidName), errors.Is(err, pglock.ErrInvalidTTL), errors.Is(err, pglock.ErrInvalidHolder):
			return nil, nil, nil, withCode(ExitUsage, err)
		}
		return nil, nil, nil, err
	}
	return locker, lease, cleanup, nil
}

func (a *app) runCommand() *cobra.Command {
	var f leaseFlags
	var grace time.Duration
	cmd := &cobra.Command{
		Use:   "run --lock NAME [--ttl 30s] [--no-wait] -- COMMAND [ARGS...]",
		Short: "Run a command while holding a lease, like flock(1) across machines",
		Long: `Acquire the lease NAME (waiting, or failing at once with --no-wait), run COMMAND
with PGFENCE_LOCK, PGFENCE_TOKEN and PGFENCE_HOLDER in its environment, renew the
lease while it runs, and release it when it exits. pgfence exits with the
command's exit status.

If the lease is lost while the command runs (a renewal is refused, or the
database cannot be reached before the lease's local deadline), the command gets
SIGTERM, then SIGKILL after --grace, and pgfence exits with code 76. A lost
lease is only a signal: the command must pass PGFENCE_TOKEN to fenced writes,
because it may still write between the loss and its termination.

Exit codes: the command's status; 75 lock busy (--no-wait); 76 lease lost;
1 error; 2 usage.`,
		Example: `  pgfence run --lock nightly-settlement --ttl 60s -- ./settle --date today
  pgfence run --lock report --no-wait -- sh -c 'echo token $PGFENCE_TOKEN'`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if grace <= 0 {
				return usageErr("--grace must be > 0")
			}
			ctx := cmd.Context()
			_, lease, cleanup, err := a.takeLease(ctx, &f, true)
			if err != nil {
				return err
			}
			defer cleanup()

			child := exec.Command(args[0], args[1:]...)
			child.Env = append(os.Environ(),
				"PGFENCE_LOCK="+lease.Name(),
				"PGFENCE_TOKEN="+strconv.FormatInt(lease.Token(), 10),
				"PGFENCE_HOLDER="+lease.Holder(),
			)
			// The child's output is copied by exec's goroutines while pgfence
			// writes its own notes: serialise both on one lock.
			var outMu sync.Mutex
			stdout := &lockedWriter{mu: &outMu, w: a.env.Stdout}
			stderr := &lockedWriter{mu: &outMu, w: a.env.Stderr}
			child.Stdin, child.Stdout, child.Stderr = a.env.Stdin, stdout, stderr
			if err := child.Start(); err != nil {
				_ = lease.Release(context.WithoutCancel(ctx))
				return fmt.Errorf("start %s: %w", args[0], err)
			}
			fmt.Fprintf(stderr, "pgfence: lock %q held, token %d; started %s (pid %d)\n", lease.Name(), lease.Token(), args[0], child.Process.Pid)
			waited := make(chan error, 1)
			go func() { waited <- child.Wait() }()

			terminate := func() error {
				_ = child.Process.Signal(syscall.SIGTERM)
				select {
				case err := <-waited:
					return err
				case <-time.After(grace):
					_ = child.Process.Kill()
					return <-waited
				}
			}

			var werr error
			lost := false
			select {
			case werr = <-waited:
			case <-lease.Done():
				lost = true
				fmt.Fprintf(stderr, "pgfence: lease on %q lost (%v); sending SIGTERM to %s\n", lease.Name(), lease.Err(), args[0])
				werr = terminate()
			case <-ctx.Done():
				fmt.Fprintf(stderr, "pgfence: interrupted; sending SIGTERM to %s\n", args[0])
				werr = terminate()
			}
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			if rerr := lease.Release(rctx); rerr != nil && !lost {
				fmt.Fprintf(stderr, "pgfence: release %q: %v\n", lease.Name(), rerr)
			}
			if lost {
				return withCode(ExitLeaseLost, fmt.Errorf("lease on %q lost while %s ran", lease.Name(), args[0]))
			}
			return childExit(werr)
		},
	}
	f.register(cmd, 30*time.Second)
	cmd.Flags().DurationVar(&grace, "grace", 10*time.Second, "time between SIGTERM and SIGKILL when the lease is lost")
	return cmd
}

// childExit maps a child's wait error to pgfence's own exit: the child's status,
// or 128+signal when it was killed by a signal.
func childExit(err error) error {
	if err == nil {
		return nil
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return withCode(128+int(ws.Signal()), fmt.Errorf("command killed by %v", ws.Signal()))
		}
		return withCode(ee.ExitCode(), fmt.Errorf("command exited with status %d", ee.ExitCode()))
	}
	return err
}

func (a *app) acquireCommand() *cobra.Command {
	var f leaseFlags
	var jsonOut bool
	cmd := &cobra.Command{
		Use:   "acquire --lock NAME [--ttl 60s] [--no-wait]",
		Short: "Acquire a lease for a shell script and print its token (renew/release it later by holder and token)",
		Long: `Acquire the lease NAME and print shell assignments for eval:

  PGFENCE_LOCK=... PGFENCE_TOKEN=... PGFENCE_HOLDER=... PGFENCE_EXPIRES_AT=...

The lease is not renewed after pgfence exits: renew it with 'pgfence renew'
before it expires and release it with 'pgfence release'.`,
		Example: `  eval "$(pgfence acquire --lock nightly --ttl 5m)"
  ./job --fence-token "$PGFENCE_TOKEN"
  pgfence release --lock "$PGFENCE_LOCK" --holder "$PGFENCE_HOLDER" --token "$PGFENCE_TOKEN"`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, lease, cleanup, err := a.takeLease(cmd.Context(), &f, false)
			if err != nil {
				return err
			}
			defer cleanup()
			if jsonOut {
				return writeJSON(a.env.Stdout, map[string]any{
					"lock": lease.Name(), "token": lease.Token(), "holder": lease.Holder(), "expires_at": lease.ExpiresAt(),
				})
			}
			fmt.Fprintf(a.env.Stdout, "PGFENCE_LOCK=%s\nPGFENCE_TOKEN=%d\nPGFENCE_HOLDER=%s\nPGFENCE_EXPIRES_AT=%s\n",
				shellQuote(lease.Name()), lease.Token(), shellQuote(lease.Holder()), lease.ExpiresAt().UTC().Format(time.RFC3339Nano))
			return nil
		},
	}
	f.register(cmd, 60*time.Second)
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print JSON")
	return cmd
}

type tokenFlags struct {
	lock, holder string
	token        int64
	ttl          time.Duration
}

func (a *app) tokenLocker(ctx context.Context, f *tokenFlags) (*pglock.Locker, func(), error) {
	if f.lock == "" || f.holder == "" || f.token == 0 {
		return nil, nil, usageErr("--lock, --holder and --token are required")
	}
	pool, err := a.connectMigrated(ctx)
	if err != nil {
		return nil, nil, err
	}
	locker, err := pglock.New(pool, &pglock.Config{Holder: f.holder})
	if err != nil {
		pool.Close()
		return nil, nil, withCode(ExitUsage, err)
	}
	return locker, func() { _ = locker.Close(); pool.Close() }, nil
}

func leaseErr(err error) error {
	switch {
	case errors.Is(err, pglock.ErrLeaseLost):
		return withCode(ExitLeaseLost, err)
	case errors.Is(err, pglock.ErrInvalidName), errors.Is(err, pglock.ErrInvalidTTL),
		errors.Is(err, pglock.ErrInvalidHolder), errors.Is(err, pglock.ErrInvalidToken):
		return withCode(ExitUsage, err)
	}
	return err
}

func (a *app) renewCommand() *cobra.Command {
	var f tokenFlags
	var jsonOut bool
	cmd := &cobra.Command{
		Use:   "renew --lock NAME --holder H --token N [--ttl 60s]",
		Short: "Renew a lease taken with 'pgfence acquire' (exit 76 if it was lost)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			locker, cleanup, err := a.tokenLocker(cmd.Context(), &f)
			if err != nil {
				return err
			}
			defer cleanup()
			exp, err := locker.RenewToken(cmd.Context(), f.lock, f.holder, f.token, f.ttl)
			if err != nil {
				return leaseErr(err)
			}
			if jsonOut {
				return writeJSON(a.env.Stdout, map[string]any{"lock": f.lock, "token": f.token, "expires_at": exp})
			}
			fmt.Fprintf(a.env.Stdout, "PGFENCE_EXPIRES_AT=%s\n", exp.UTC().Format(time.RFC3339Nano))
			return nil
		},
	}
	cmd.Flags().StringVar(&f.lock, "lock", "", "lock name")
	cmd.Flags().StringVar(&f.holder, "holder", "", "holder printed by acquire")
	cmd.Flags().Int64Var(&f.token, "token", 0, "token printed by acquire")
	cmd.Flags().DurationVar(&f.ttl, "ttl", 60*time.Second, "new lease duration from now (database clock)")
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print JSON")
	return cmd
}

func (a *app) releaseCommand() *cobra.Command {
	var f tokenFlags
	cmd := &cobra.Command{
		Use:   "release --lock NAME --holder H --token N",
		Short: "Release a lease taken with 'pgfence acquire' (exit 76 if it was already lost)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			locker, cleanup, err := a.tokenLocker(cmd.Context(), &f)
			if err != nil {
				return err
			}
			defer cleanup()
			if err := locker.ReleaseToken(cmd.Context(), f.lock, f.holder, f.token); err != nil {
				return leaseErr(err)
			}
			fmt.Fprintf(a.env.Stdout, "released %s (token %d)\n", f.lock, f.token)
			return nil
		},
	}
	cmd.Flags().StringVar(&f.lock, "lock", "", "lock name")
	cmd.Flags().StringVar(&f.holder, "holder", "", "holder printed by acquire")
	cmd.Flags().Int64Var(&f.token, "token", 0, "token printed by acquire")
	return cmd
}

func shellQuote(s string) string {
	safe := s != ""
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.' || r == '/' || r == ':') {
			safe = false
			break
		}
	}
	if safe {
		return s
	}
	out := "'"
	for _, r := range s {
		if r == '\'' {
			out += `'\''`
		} else {
			out += string(r)
		}
	}
	return out + "'"
}

// lockedWriter serialises writes to w on mu.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
