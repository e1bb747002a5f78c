package cli

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/pgtext"
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

// The lease commands check their flags as pglock does, before connecting:
// exit 2 for bad input whether or not the database can be reached (pglock
// checks again after, as for any caller).
const (
	maxLockNameBytes = 512 // pglock: 1..512 bytes of UTF-8 without NUL
	minLeaseKeyBytes = 16  // pglock.Config.Key: 16..64 bytes
	maxLeaseKeyBytes = 64
)

// check refuses a lock name, TTL or holder pglock would refuse.
func (f *leaseFlags) check() error {
	if err := checkLockName(f.lock); err != nil {
		return err
	}
	if err := checkLeaseTTL(f.ttl); err != nil {
		return err
	}
	if f.holder != "" {
		if len(f.holder) > maxLockNameBytes {
			return usageErr("--holder: %d bytes, more than %d", len(f.holder), maxLockNameBytes)
		}
		if p := pgtext.Problem(f.holder); p != "" {
			return usageErr("--holder: %s", p)
		}
	}
	return nil
}

func checkLockName(name string) error { return checkNamed("--lock", name) }

// checkNamed refuses a lock name pglock would refuse; what names it in the
// message (a flag, or "lock name" for an argument).
func checkNamed(what, name string) error {
	switch {
	case name == "":
		return usageErr("%s is required", what)
	case len(name) > maxLockNameBytes:
		return usageErr("%s: %d bytes, more than %d", what, len(name), maxLockNameBytes)
	}
	if p := pgtext.Problem(name); p != "" {
		return usageErr("%s: %s", what, p)
	}
	return nil
}

func checkLeaseTTL(ttl time.Duration) error {
	if ttl < pglock.MinTTL || ttl > pglock.MaxTTL {
		return usageErr("--ttl %v: must be between %v and %v", ttl, pglock.MinTTL, pglock.MaxTTL)
	}
	return nil
}

// takeLease connects, builds a Locker and acquires (or try-acquires) f.lock.
func (a *app) takeLease(ctx context.Context, f *leaseFlags, keepAlive bool) (*pglock.Locker, *pglock.Lease, func(), error) {
	if err := f.check(); err != nil {
		return nil, nil, nil, err
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
		var le *pgfence.Error
		switch {
		case errors.Is(err, pgfence.ErrLocked) && errors.As(err, &le):
			return nil, nil, nil, withCode(ExitLockBusy, fmt.Errorf("lock %s is busy: held by %s until %s", termSafe(le.Name), termSafe(le.Holder), le.ExpiresAt.UTC().Format(time.RFC3339)))
		case errors.Is(err, pgfence.ErrInvalid):
			return nil, nil, nil, withCode(ExitUsage, err)
		}
		return nil, nil, nil, err
	}
	return locker, lease, cleanup, nil
}

func (a *app) runCommand() *cobra.Command {
	var f leaseFlags
	var grace time.Duration
	var passEnv bool
	cmd := &cobra.Command{
		Use:   "run --lock NAME [--ttl 30s] [--no-wait] [--grace 10s] [--pass-env] -- COMMAND [ARGS...]",
		Short: "Run a command while holding a lease, like flock(1) across machines",
		Long: `Acquire the lease NAME (waiting, or failing at once with --no-wait), run COMMAND
with PGFENCE_LOCK, PGFENCE_TOKEN and PGFENCE_HOLDER in its environment, renew the
lease while it runs, and release it once the command and every process it
started are gone. pgfence exits with the command's exit status.

Before the lease is taken, COMMAND is looked up in PATH and, if it is a script
pgfence can read, the interpreter on its #! line is checked as Linux reads it
(the path after "#!" up to the next space or tab; a relative one against the
current directory): if either is not found (or COMMAND is empty) pgfence exits
127, if either cannot be executed 126, and no token is used up. Any other
failure to start COMMAND (a format the system cannot run, a missing dynamic
loader, a noexec mount) comes after the lease is taken: pgfence releases it
and exits 127 if the system reports a missing file, 126 otherwise.

Stopping. The command runs in a process group of its own. If the lease is lost
(a renewal is refused, or the database cannot be reached before the lease's
local deadline), or pgfence gets SIGINT, SIGTERM, SIGHUP or SIGQUIT, the whole
tree gets SIGTERM, then SIGKILL after --grace; a second signal sends SIGKILL at
once. A lease that is not being renewed is not waited out: the tree gets
SIGTERM --grace (at most a third of --ttl) before the lease's local deadline,
and SIGKILL just before that deadline. pgfence exits 76 (lease lost) or 128+signal once the tree is gone, and
releases the lease only then. If the command exits while processes it started
still run, they are stopped the same way before the lease is released. A lost
lease is only a signal: the command must pass PGFENCE_TOKEN to fenced writes,
because it may still write between the loss and its end.

If pgfence dies (Linux). pgfence starts the command through a supervisor, itself
re-executed as "pgfence __run-supervise" (an internal helper that takes no
user input), which is the child subreaper of the whole tree: a process that
leaves the command's process group or session is still found. When pgfence
dies, even by SIGKILL or the OOM killer, the supervisor reads end-of-file on a
pipe from pgfence and sends SIGKILL to every process of the tree at once; the
lease, no longer renewed, expires on the database clock within --ttl. If the
supervisor itself is killed, the command dies with it (parent-death signal),
and pgfence kills the command's process group and leaves the lease to expire.

Other platforms. On other Unix systems (macOS, the BSDs) the command's process
group is stopped as above, but processes that leave the group are not, and if
pgfence is killed with SIGKILL the command keeps running without a lease. On
Windows pgfence run refuses to start.

Terminal. The command is not in the terminal's foreground process group: Ctrl-C
reaches pgfence, which stops the tree; Ctrl-Z (SIGTSTP) stops the command's
process group and pgfence together, and fg or bg (SIGCONT) continues both; a
command that reads from the terminal is stopped by the kernel (SIGTTIN), so
give it input from a file or a pipe.

Environment. DATABASE_URL, PGPASSWORD and PGSSLPASSWORD are removed from the
command's environment, so a job that logs its environment does not print the
lock database's password; --pass-env keeps them (use it when the command
writes to the same database with fenced writes). Variables that only name a
file (PGPASSFILE, PGSERVICEFILE, PGSSLKEY) and the other PG* variables are
kept. PGFENCE_KEY and PGFENCE_EXPIRES_AT (another lease's) are removed too.
This is hygiene, not a boundary: the command runs as the same user.

Exit codes: the command's status (128+N if signal N killed it); 75 lock busy
(--no-wait); 76 lease lost; 126 command not executable; 127 command not found;
128+N pgfence got signal N; 1 error (also: the tree could not be stopped, the
lease is then left to expire); 2 usage.`,
		Example: `  pgfence run --lock nightly-settlement --ttl 60s -- ./settle --date today
  pgfence run --lock report --no-wait -- sh -c 'echo token $PGFENCE_TOKEN'
  DATABASE_URL=... pgfence run --lock import --pass-env -- ./import --fence-token-env PGFENCE_TOKEN`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.runLeased(cmd.Context(), &f, grace, passEnv, args)
		},
	}
	f.register(cmd, 30*time.Second)
	cmd.Flags().DurationVar(&grace, "grace", 10*time.Second, "time between SIGTERM and SIGKILL when the command's tree is stopped, at most 24h (a lease not being renewed: SIGTERM this long, at most a third of --ttl, before its deadline)")
	cmd.Flags().BoolVar(&passEnv, "pass-env", false, "keep DATABASE_URL, PGPASSWORD and PGSSLPASSWORD in the command's environment")
	return cmd
}

func (a *app) acquireCommand() *cobra.Command {
	var f leaseFlags
	var jsonOut bool
	cmd := &cobra.Command{
		Use:   "acquire --lock NAME [--ttl 60s] [--no-wait]",
		Short: "Acquire a lease for a shell script and print its token and key (renew/release it later with both)",
		Long: `Acquire the lease NAME and print shell assignments for eval:

  PGFENCE_LOCK=... PGFENCE_TOKEN=... PGFENCE_KEY=... PGFENCE_HOLDER=... PGFENCE_EXPIRES_AT=...

The lease is not renewed after pgfence exits: renew it with 'pgfence renew'
before it expires and release it with 'pgfence release', passing the token and
the key. PGFENCE_KEY is the lease key (hex): whoever knows it can renew and
release the lease, so keep it out of logs; the token alone is not enough. If
the output cannot be written, acquire releases the lease and exits 1.`,
		Example: `  eval "$(pgfence acquire --lock nightly --ttl 5m)"
  ./job --fence-token "$PGFENCE_TOKEN"
  PGFENCE_KEY="$PGFENCE_KEY" pgfence release --lock "$PGFENCE_LOCK" --token "$PGFENCE_TOKEN"`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, lease, cleanup, err := a.takeLease(cmd.Context(), &f, false)
			if err != nil {
				return err
			}
			defer cleanup()
			key := hex.EncodeToString(lease.Key())
			var werr error
			if jsonOut {
				werr = writeJSON(a.env.Stdout, map[string]any{
					"lock": lease.Name(), "token": lease.Token(), "key": key, "holder": lease.Holder(), "expires_at": lease.ExpiresAt(),
				})
			} else {
				_, werr = fmt.Fprintf(a.env.Stdout, "PGFENCE_LOCK=%s\nPGFENCE_TOKEN=%d\nPGFENCE_KEY=%s\nPGFENCE_HOLDER=%s\nPGFENCE_EXPIRES_AT=%s\n",
					shellQuote(lease.Name()), lease.Token(), key, shellQuote(lease.Holder()), lease.ExpiresAt().UTC().Format(time.RFC3339Nano))
			}
			if werr != nil {
				// Nobody got the key: nobody could renew or release the
				// lease, which would stay held for its TTL. Give it back,
				// even when ctx is cancelled, within a bound.
				rctx, cancel := context.WithTimeout(context.WithoutCancel(cmd.Context()), releaseTimeout)
				defer cancel()
				if rerr := lease.Release(rctx); rerr != nil {
					return fmt.Errorf("cannot write the lease to stdout: %w; releasing it failed too (it expires at %s): %v",
						werr, lease.ExpiresAt().UTC().Format(time.RFC3339), oneLine(rerr))
				}
				return fmt.Errorf("cannot write the lease to stdout: %w; the lease was released", werr)
			}
			return nil
		},
	}
	f.register(cmd, 60*time.Second)
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print JSON")
	return cmd
}

// releaseTimeout bounds the release of a lease pgfence could not hand over.
const releaseTimeout = 10 * time.Second

type tokenFlags struct {
	lock, key string
	token     int64
	ttl       time.Duration
}

func (f *tokenFlags) register(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.lock, "lock", "", "lock name")
	cmd.Flags().Int64Var(&f.token, "token", 0, "token printed by acquire")
	cmd.Flags().StringVar(&f.key, "key", "", "lease key printed by acquire (hex); default: the environment variable PGFENCE_KEY, "+
		"which, unlike a command-line argument, other users cannot read")
}

func (a *app) tokenLocker(ctx context.Context, f *tokenFlags) (*pglock.Locker, func(), error) {
	if f.key == "" {
		// A command line is visible to every user of the machine (ps,
		// /proc/PID/cmdline); a process's environment only to its own.
		f.key = a.env.Getenv("PGFENCE_KEY")
	}
	if f.lock == "" || f.key == "" || f.token == 0 {
		return nil, nil, usageErr("--lock, --token and --key (or PGFENCE_KEY in the environment) are required")
	}
	if err := checkLockName(f.lock); err != nil {
		return nil, nil, err
	}
	if f.token < 0 {
		return nil, nil, usageErr("--token %d: must be > 0", f.token)
	}
	key, err := hex.DecodeString(f.key)
	if err != nil {
		return nil, nil, usageErr("--key is not hex: %v", err)
	}
	if len(key) < minLeaseKeyBytes || len(key) > maxLeaseKeyBytes {
		return nil, nil, usageErr("--key: %d bytes, want %d to %d (the key acquire printed)", len(key), minLeaseKeyBytes, maxLeaseKeyBytes)
	}
	pool, err := a.connectMigrated(ctx)
	if err != nil {
		return nil, nil, err
	}
	locker, err := pglock.New(pool, &pglock.Config{Key: key})
	if err != nil {
		pool.Close()
		return nil, nil, withCode(ExitUsage, err)
	}
	return locker, func() { _ = locker.Close(); pool.Close() }, nil
}

// leaseErr gives the exit code of an error of RenewToken or ReleaseToken.
// The holder pglock puts in the message is dropped: it is the holder of
// this process's Locker (random, never stored), not the lease's.
func leaseErr(err error) error {
	if pe, ok := err.(*pgfence.Error); ok && pe.Holder != "" {
		c := *pe
		c.Holder, c.ExpiresAt = "", time.Time{}
		err = &c
	}
	switch {
	case errors.Is(err, pgfence.ErrLost):
		return withCode(ExitLeaseLost, err)
	case errors.Is(err, pgfence.ErrInvalid):
		return withCode(ExitUsage, err)
	}
	return err
}

func (a *app) renewCommand() *cobra.Command {
	var f tokenFlags
	var jsonOut bool
	cmd := &cobra.Command{
		Use:   "renew --lock NAME --token N [--key KEY] [--ttl 60s]",
		Short: "Renew a lease taken with 'pgfence acquire' (exit 76 if it was lost)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkLeaseTTL(f.ttl); err != nil {
				return err
			}
			locker, cleanup, err := a.tokenLocker(cmd.Context(), &f)
			if err != nil {
				return err
			}
			defer cleanup()
			exp, err := locker.RenewToken(cmd.Context(), f.lock, f.token, f.ttl)
			if err != nil {
				return leaseErr(err)
			}
			var werr error
			if jsonOut {
				werr = writeJSON(a.env.Stdout, map[string]any{"lock": f.lock, "token": f.token, "expires_at": exp})
			} else {
				_, werr = fmt.Fprintf(a.env.Stdout, "PGFENCE_EXPIRES_AT=%s\n", exp.UTC().Format(time.RFC3339Nano))
			}
			if werr != nil {
				return fmt.Errorf("renewed until %s, but cannot write to stdout: %w", exp.UTC().Format(time.RFC3339Nano), werr)
			}
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().DurationVar(&f.ttl, "ttl", 60*time.Second, "new lease duration from now (database clock)")
	cmd.Flags().BoolVar(&jsonOut, "json", false, "print JSON")
	return cmd
}

func (a *app) releaseCommand() *cobra.Command {
	var f tokenFlags
	cmd := &cobra.Command{
		Use:   "release --lock NAME --token N [--key KEY]",
		Short: "Release a lease taken with 'pgfence acquire' (exit 76 if it was already lost)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			locker, cleanup, err := a.tokenLocker(cmd.Context(), &f)
			if err != nil {
				return err
			}
			defer cleanup()
			if err := locker.ReleaseToken(cmd.Context(), f.lock, f.token); err != nil {
				return leaseErr(err)
			}
			if _, err := fmt.Fprintf(a.env.Stdout, "released %s (token %d)\n", termSafe(f.lock), f.token); err != nil {
				return fmt.Errorf("released, but cannot write to stdout: %w", err)
			}
			return nil
		},
	}
	f.register(cmd)
	return cmd
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
